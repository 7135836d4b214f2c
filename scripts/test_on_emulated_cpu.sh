#!/usr/bin/env bash
# Run tests as on another x86-64 CPU: pytest and every python it starts run under qemu-user with
# that CPU model, and /proc/cpuinfo shows that CPU (a private mount namespace: root, or unprivileged
# user namespaces). Default: an AMD EPYC Rome (AVX2, no AVX-512). Needs qemu-user and a C compiler.
#   bash scripts/test_on_emulated_cpu.sh                          # EPYC-Rome, tests/test_blas.py
#   bash scripts/test_on_emulated_cpu.sh Nehalem tests/test_blas.py -x -q
# tests/test_blas_emulated.py emulates CPUs by itself: run it natively.
set -euo pipefail
cd "$(dirname "$0")/.."
cpu=${1:-EPYC-Rome}
shift || true
[ $# -gt 0 ] || set -- tests/test_blas.py -q
python=${PYTHON:-$PWD/.venv/bin/python}
qemu=$(command -v qemu-x86_64) || { echo "needs qemu-x86_64 (apt install qemu-user)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cc -O1 -o "$tmp/cpuinfo-tool" scripts/cpuinfo_from_cpuid.c
"$qemu" -cpu "$cpu" "$tmp/cpuinfo-tool" "$cpu (qemu)" >"$tmp/cpuinfo" 2>/dev/null
printf '#!/bin/sh\nexec %s -cpu %s %s "$@"\n' "$qemu" "$cpu" "$python" >"$tmp/python"
chmod +x "$tmp/python"
# Every python started here: its children run on the emulated CPU too (qemu-user would run them natively), and
# the BLAS probe's sgemm is 128- instead of 512-cubed (qemu runs AVX2 kernels at ~0.01 GFLOP/s).
cat >"$tmp/sitecustomize.py" <<PY
import sys
sys.executable = "$tmp/python"
from kvpolicy_core.runtime import blas_check
blas_check.PROBE_N = 128
PY
echo "emulated CPU: $(grep '^flags' "$tmp/cpuinfo")" >&2
ns=(unshare -m)
[ "$(id -u)" = 0 ] || ns=(unshare -rm)
PYTHONPATH="$tmp${PYTHONPATH:+:$PYTHONPATH}" KVPOLICY_CACHE="$tmp/cache" "${ns[@]}" sh -c \
  'mount --bind "$1" /proc/cpuinfo && shift && exec "$@"' sh "$tmp/cpuinfo" \
  "$qemu" -cpu "$cpu" "$python" -m pytest -p no:cacheprovider "$@" 2> >(grep -v "TCG doesn.t support" >&2)
