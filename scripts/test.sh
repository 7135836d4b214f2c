#!/usr/bin/env bash
# Install everything (scripts/setup.sh --test: with qemu-user, which only the tests need), check style (ruff lint
# and format), then run the whole test suite, integration tests included, on every core up to 4 (pytest-xdist; a file's tests stay on one worker, so its
# fixtures are built once). Extra arguments go to pytest (e.g. -m "not slow and not integration", or -n 0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test  # with what only the tests need (qemu-user)
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile "$@"
