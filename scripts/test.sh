#!/usr/bin/env bash
# The test command README.md gives: set up .venv with the test extras, then run pytest.
# Without arguments: every test, the fast tier on 2 workers (pytest-xdist), then the slow tiers
# (training runs, servers, the wheel) one at a time, since they time real processes.
# With arguments: pytest with those arguments (e.g. -m "not slow" -n 2, or one file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if [ "$#" -eq 0 ]; then
  .venv/bin/python -m pytest -q -m "not slow" -n 2
  exec .venv/bin/python -m pytest -q -m slow
fi
exec .venv/bin/python -m pytest -q "$@"
