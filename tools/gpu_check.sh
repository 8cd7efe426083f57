#!/usr/bin/env bash
# GPU check on one H200 (or any CUDA machine): every test marked `gpu` (parity with NCCL and, when it imports,
# the Transformer Engine spec; weight sync into official vLLM when vLLM imports and two GPUs exist).
# Offline machines (the lent H200 has no network): run tools/fetch_wheels.sh here first and carry `.whl`; its
# wheels go to /tmp/site and the package runs from this checkout (PYTHONPATH), so nothing is fetched.
# Networked machines without `.whl`: pip installs the package with its gpu extra.
# Budget: under 8 minutes (installs at most 120 s offline or 180 s online, the tests at most 300 s). Logs land in
# $OUT (default /tmp/megatron-rl-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/megatron-rl-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -3 || echo "installing .whl failed" | tee -a "$OUT/gpu.txt"
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    timeout 180 "$PY" -m pip install -q -e ".[gpu,dev]" 2>&1 | tail -3 || echo "gpu extra install failed" | tee -a "$OUT/gpu.txt"
fi
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt"
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "gpus", torch.cuda.device_count())
for name in ("megatron.core", "transformer_engine", "vllm", "ray", "pytest", "pytest_timeout", "megatron_rl"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "imported"))
    except Exception as err:  # report, do not stop: the tests that need it skip
        print(name, "NOT importable:", type(err).__name__, str(err)[:200])
PY
set -e
PYTHONUNBUFFERED=1 timeout 300 "$PY" -m pytest -m gpu -v -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
