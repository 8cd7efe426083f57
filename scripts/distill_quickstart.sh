#!/usr/bin/env bash
# On-policy distillation on a CPU machine: a fresh tiny student learns the quickstart task from the RL
# quickstart's exported policy (runs/quickstart/hf), which this script makes first when it is missing.
# Writes runs/distill_quickstart/. Overrides and flags go after it: bash scripts/distill_quickstart.sh steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f runs/quickstart/hf/config.json ]; then
  echo "no teacher at runs/quickstart/hf: running the RL quickstart first (scripts/quickstart.sh)"
  bash scripts/quickstart.sh
fi
exec .venv/bin/megatron-rl train configs/distill_quickstart.yaml "$@" --overwrite
