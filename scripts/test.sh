#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the whole test suite, integration tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
