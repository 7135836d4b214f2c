#!/usr/bin/env bash
# The main job: install everything, then compare the full cache, StreamingLLM (mlx-lm's
# RotatingKVCache), H2O and CaM on the embedded Gemma 3 270M:
#  1. token-by-token perplexity of the pydoc corpus, 64-token budget over 320 tokens (5x compression);
#  2. retrieval: a 5-digit number hidden at depths 0, 0.5, 1 of a 500-token pydoc haystack, asked for at
#     the end of the prompt (one-chunk prefill), 128-token budget (~4.4x compression).
# Then prints both side by side (benchmarks/demo_table.py).
#
# This run's results go to benchmarks/results/local/ (ignored by git): the run leaves the tree as it was, and
# the recorded numbers (docs/results/benchmarks.md) stay benchmarks/results/demo.json and demo_needle.json (copy a run
# there to record it).
# Progress bars only on a terminal: with stderr to a file or a pipe, one line per step and per method instead.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/local
if [ ! -t 2 ]; then
    export TQDM_DISABLE="${TQDM_DISABLE:-1}" HF_HUB_DISABLE_PROGRESS_BARS="${HF_HUB_DISABLE_PROGRESS_BARS:-1}"
fi
step() { echo "demo: [$1/4] $2" >&2; }
step 1 "set-up (scripts/setup.sh)"
bash scripts/setup.sh
mkdir -p "$OUT"
step 2 "perplexity: full, rotating, h2o, cam; 320 tokens, budget 64 (about 2 min)"
.venv/bin/kvpolicy eval --tokens 320 --budget 64 --json "$OUT/demo.json" "$@"
step 3 "retrieval: a needle at depths 0, 0.5, 1 of 500 tokens, budget 128 (about 1 min)"
.venv/bin/kvpolicy eval --task needle --lengths 500 --depths 0,0.5,1 --budget 128 \
    --json "$OUT/demo_needle.json"
step 4 "the table (results in $OUT/, ignored by git)"
echo
.venv/bin/python benchmarks/demo_table.py "$OUT/demo.json" "$OUT/demo_needle.json"
