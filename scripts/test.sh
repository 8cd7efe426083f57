#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs every test that this machine can run
# (tests marked `gpu` skip themselves without CUDA; `slow` ones run only with --slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MARK="not slow"
if [ "${1:-}" = "--slow" ]; then MARK=""; shift; fi
exec .venv/bin/python -m pytest -m "$MARK" "$@"
