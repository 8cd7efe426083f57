#!/usr/bin/env bash
# GPU check on one H200 (or any CUDA machine): installs official vLLM (CUDA torch) and the package, then runs
# every test marked `gpu` (parity with NCCL and, when it imports, the Transformer Engine spec; weight sync when
# two GPUs exist). Budget: under 8 minutes; each step has its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/megatron-rl-gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pip install -q "vllm>=0.11" "ray[default]>=2.50" 2>&1 | tail -3 || echo "vllm install failed" | tee -a "$OUT/gpu.txt"
timeout 120 python3 -m pip install -q -e ".[dev]" "megatron-core>=0.16.1" 2>&1 | tail -3
python3 -c "import transformer_engine" 2>/dev/null || echo "transformer-engine not importable: local spec only" | tee -a "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -m gpu -v tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
