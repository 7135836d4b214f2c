#!/usr/bin/env bash
# The main job: install everything, then compare the full cache, StreamingLLM (mlx-lm's
# RotatingKVCache), H2O and CaM on the embedded Gemma 3 270M and the pydoc corpus:
# token-by-token perplexity with a 64-token budget over 320 tokens (5x compression).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvpolicy eval --tokens 320 --budget 64 --json benchmarks/results/demo.json "$@"
