"""GPU: the same parity with NCCL and, when it imports, the Transformer Engine layer spec.

Run on a lent GPU by tools/gpu_check.sh. Multi-rank layouts need one GPU per rank (NCCL refuses two ranks on
one device), so each case skips when the machine has fewer GPUs than its world size.
"""

from __future__ import annotations

import os

import pytest

from megatron_rl.parallel.layout import ParallelLayout

pytestmark = pytest.mark.gpu

LAYOUTS = {
    "1x1x1": ParallelLayout(),
    "tp2": ParallelLayout(tp=2),
    "ep2": ParallelLayout(ep=2),
    "tp2xep2": ParallelLayout(tp=2, ep=2),
    "pp2xep2": ParallelLayout(pp=2, ep=2),
}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(autouse=True)
def _exact_fp32(monkeypatch):
    # TF32 matmuls would add ~1e-3 differences that have nothing to do with the weight map.
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    os.environ.pop("OMP_NUM_THREADS", None)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "qwen3"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpu_parity(family, name, tiny_dir):
    from megatron_rl.verify.parity import run_parity

    layout = LAYOUTS[name]
    if layout.world_size > _gpus():
        pytest.skip(f"{name} needs {layout.world_size} GPUs, this machine has {_gpus()}")
    if family == "qwen3" and layout.ep > 1:
        pytest.skip("dense model")
    report = run_parity(tiny_dir(family), layout)
    assert report["max_abs_logprob_diff"] <= 1e-4, report


def test_gpu_uses_nccl_and_te_when_present(tmp_path):
    """The trainer picks NCCL on GPU, and the TE spec exactly when Transformer Engine imports."""
    import torch

    from megatron_rl.parallel.devices import backend_for_device
    from megatron_rl.trainer.model import te_available

    assert backend_for_device() == "nccl"
    try:
        import transformer_engine  # noqa: F401

        has_te = True
    except ImportError:
        has_te = False
    assert te_available() == (has_te and torch.cuda.is_available())
