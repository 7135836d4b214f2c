#!/usr/bin/env bash
# Set up a development environment in .venv: the three distributions (editable) with the
# model, benchmark and test extras. Safe to run again. On Linux it makes sure libgfortran5
# (needed by the pip-installed OpenBLAS that speeds MLX's CPU matmuls ~28x) is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if [ "$(uname -s)" = "Linux" ] && ! ldconfig -p 2>/dev/null | grep -q 'libgfortran\.so\.5'; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "setup: installing libgfortran5 (runtime of the OpenBLAS wheel)"
    apt-get install -y -q libgfortran5 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libgfortran5 >/dev/null; }
  else
    echo "setup: warning: libgfortran.so.5 is missing; install it (e.g. apt install libgfortran5) for fast MLX on CPU" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e "kvpolicy_core[model,bench,test]" -e kvpolicy_h2o -e kvpolicy_cam \
  -e examples/kvpolicy-streaming 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvpolicy_core, kvpolicy_h2o, kvpolicy_cam" || { echo "setup: install failed" >&2; exit 1; }
