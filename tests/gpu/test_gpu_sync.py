"""GPU: weight sync from the Megatron trainer (NCCL groups) into official vLLM engines, logprob parity.

NCCL refuses two ranks on one device, so trainer and engine need a GPU each: the test skips on one GPU (the
single-GPU path of a real deployment would use CUDA IPC, which this project does not implement yet).
"""

from __future__ import annotations

import pytest

from megatron_rl.parallel.layout import ParallelLayout

pytestmark = pytest.mark.gpu


def test_gpu_sync_parity(tiny_dir, monkeypatch):
    import torch

    pytest.importorskip("vllm", reason="official vLLM is not installed (an offline GPU machine cannot carry it)")
    if torch.cuda.device_count() < 2:
        pytest.skip("trainer and engine need one GPU each for an NCCL weight group")
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    from megatron_rl.verify.sync import run_sync_check

    report = run_sync_check(tiny_dir("qwen3_moe"), ParallelLayout(), engines=1, syncs=2, inflight_requests=2)
    assert report["max_abs_logprob_diff"] <= 1e-3, report
    assert report["max_abs_logprob_diff_before_sync"] > 0.5, report
    assert report["version"] == 2
