#!/usr/bin/env bash
# Install everything (scripts/setup.sh), check style (ruff lint and format), then run the whole test suite,
# integration tests included. Extra arguments go to pytest (e.g. -m "not slow and not integration").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
