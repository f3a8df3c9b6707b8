#!/usr/bin/env bash
# The main job, as README.md gives it: set up .venv (torch CPU wheel, then gradwatch) when
# missing, then run `gradwatch demo` with any flags passed through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/gradwatch demo "$@"
