#!/usr/bin/env bash
# The test command README.md gives: set up .venv with the test extras, then run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
