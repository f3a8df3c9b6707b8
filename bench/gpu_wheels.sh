#!/usr/bin/env bash
# Download into .whl/ the wheels the device check (python -m bench.gpu, bench/gpu/) needs on a lent
# GPU machine: Python 3.12 with torch 2.11+cu130 in /opt/torch/.venv, no network, and none of
# gradwatch's own dependencies but numpy, msgpack and prometheus-client (scikit-learn, pyyaml,
# requests, tqdm are there too). So: pyzmq, msgspec, pydantic with pydantic-core, annotated-types
# and typing-inspection, pydantic-settings with python-dotenv, and typing-extensions (pydantic's
# floor may be above the machine's). cp312 manylinux x86_64 builds, --no-deps, the versions this
# project's .venv runs the tests with. gradwatch itself is not installed there: bench/gpu makes the
# checkout's rooms importable.
#
# Run from the repository root; .whl/ is kept out of git through .git/info/exclude:
#
#     bash bench/gpu_wheels.sh
#
# Then the one device call (the device tool's `run`), with carry [".whl"] and timeout_s 380 (the
# check's budget is 330 s; 380 leaves room for a second run within 15 minutes of device time):
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 -m bench.gpu --out $OUT
#
# $OUT then holds gpu.json, gpu.md and gpu.log (3 files, well under the 8 that come back).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  pyzmq==27.3.0
  msgspec==0.23.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  pydantic-settings==2.16.3
  python-dotenv==1.2.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
PY="${PYTHON:-.venv/bin/python}"

grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"

# one wheel per package, every one asked for, and within the 64 MiB a device call carries
"$PY" - "${WHEELS[@]}" <<'EOF'
import os, re, sys
names = sorted(re.sub(r"[-_.]+", "_", w.split("==")[0].lower())
               for w in sys.argv[1:])
files = sorted(os.listdir(".whl"))
got = sorted(re.sub(r"[-_.]+", "_", f.split("-")[0].lower()) for f in files)
size = sum(os.path.getsize(os.path.join(".whl", f)) for f in files)
if got != names:
    sys.exit(f"gpu_wheels: wheels {got} do not match the list {names}")
if size > 48 << 20:
    sys.exit(f"gpu_wheels: {size / 2**20:.1f} MiB of wheels, too much beside the tree (64 MiB a call)")
for f in files:
    print(f)
print(f"{len(files)} wheels, {size / 2**20:.1f} MiB in .whl/")
EOF
