#!/usr/bin/env bash
# The main job: install everything, then compare the full cache, StreamingLLM (mlx-lm's
# RotatingKVCache), H2O and CaM on the embedded Gemma 3 270M:
#  1. token-by-token perplexity of the pydoc corpus, 64-token budget over 320 tokens (5x compression);
#  2. retrieval: a 5-digit number hidden at depths 0, 0.5, 1 of a 500-token pydoc haystack, asked for at
#     the end of the prompt (one-chunk prefill), 128-token budget (~4.4x compression).
# Then prints both side by side (benchmarks/demo_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvpolicy eval --tokens 320 --budget 64 --json benchmarks/results/demo.json "$@"
.venv/bin/kvpolicy eval --task needle --lengths 500 --depths 0,0.5,1 --budget 128 --no-progress \
    --json benchmarks/results/demo_needle.json
echo
.venv/bin/python benchmarks/demo_table.py
