#!/usr/bin/env bash
# The main job on a CPU machine. Until the async RL loop lands, it is the foundation's real job: make a tiny
# Qwen3-MoE checkpoint, convert it to a Megatron distributed checkpoint at TP2xEP2, prove logprob parity with
# Hugging Face at EP2 (loaded from that checkpoint), and convert it back bit-identically.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MRL=.venv/bin/megatron-rl
RUN=runs/quickstart
mkdir -p "$RUN"
[ -f "$RUN/tiny-hf/config.json" ] || "$MRL" make-tiny --family qwen3_moe --out "$RUN/tiny-hf"
"$MRL" convert hf-to-mcore --hf "$RUN/tiny-hf" --out "$RUN/mcore" --tp 2 --ep 2 --overwrite --json
"$MRL" verify parity --hf "$RUN/tiny-hf" --ep 2 --json | tee "$RUN/parity.json"
"$MRL" convert mcore-to-hf --mcore "$RUN/mcore" --out "$RUN/hf-back" --overwrite --json
"$MRL" verify roundtrip "$RUN/tiny-hf" "$RUN/hf-back" --json | tee "$RUN/roundtrip.json"
