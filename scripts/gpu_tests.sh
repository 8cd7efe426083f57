#!/usr/bin/env bash
# GPU check on one H200 (or any single CUDA GPU): installs, then runs every test marked `gpu`.
# Budget: under 8 minutes including installs on a machine that has torch with CUDA already.
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/megatron-rl-gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if ! python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  python3 -m pip install -q "torch>=2.6"
fi
python3 -m pip install -q -e ".[dev]" "megatron-core>=0.16.1"
python3 -c "import transformer_engine" 2>/dev/null || echo "transformer-engine not importable: the TE-spec tests will skip" | tee -a "$OUT/gpu.txt"
set -o pipefail
timeout 450 python3 -m pytest -m gpu -v tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
