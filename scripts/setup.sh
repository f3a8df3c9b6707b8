#!/usr/bin/env bash
# Create .venv and install torch (pinned; TORCH_INDEX_URL for the CPU build) then gradwatch, when missing. Idempotent.
# Usage: scripts/setup.sh [extra]   (extra: demo, test, bench)
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-demo}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned, so pip never resolves a multi-GB CUDA build for the range in pyproject;
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) picks where the wheel comes from
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
stamp=".venv/.gradwatch-$extra-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -e "$stamp" ]; then
  .venv/bin/pip install -q -e ".[$extra]"
  touch "$stamp"
fi
