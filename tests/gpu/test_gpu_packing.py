"""GPU: sequence packing through Transformer Engine's `thd` format (`PackedSeqParams` with cumulative sequence
lengths; the CPU tests cover the local spec's block mask). The same two RL steps padded and packed on one GPU:
equal losses and reduced gradients, as `tests/distributed/test_train_step.py` checks on CPU. And the local spec's
block mask in bf16 on a GPU, where Megatron's fused causal softmax (which ignores the mask) must stay off.

Run on a lent GPU by tools/gpu_check.sh.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_rl.parallel.torchrun import run_torchrun
from tests.distributed.test_train_step import DECOUPLED, SEQ, VOCAB, _case, make_batch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _exact_fp32(monkeypatch):
    # TF32 matmuls would add ~1e-3 differences that have nothing to do with packing.
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    os.environ.pop("OMP_NUM_THREADS", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gpu_packed_thd_matches_padded(family, tiny_dir, tmp_path):
    from megatron_rl.trainer.model import te_available

    if not te_available():
        pytest.skip("Transformer Engine does not import: the thd path is not taken")
    padded, packed = _padded_and_packed(tiny_dir(family), tmp_path, {})
    for want, have in zip(padded["steps"], packed["steps"], strict=True):
        assert abs(want["loss"] - have["loss"]) <= 1e-5, (want["loss"], have["loss"])
    a, b = (torch.load(tmp_path / f"grads-{name}.pt") for name in ("padded", "packed"))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"{family}: thd packed vs padded, largest gradient difference {diff:.3g}")
    assert diff <= 1e-5
    assert packed["steps"][0]["batch/token_fill"] >= padded["steps"][0]["batch/token_fill"]


def _padded_and_packed(hf: str, tmp_path, build: dict) -> tuple[dict, dict]:
    """The reports of the same two steps on one GPU, padded and packed, the model built with `build`."""
    batches = []
    for seed in (0, 1):
        batches.append(str(tmp_path / f"b{seed}.pt"))
        torch.save(make_batch(hf, seed), batches[-1])
    eval_path = str(tmp_path / "eval.pt")
    torch.save(torch.randint(3, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(9)), eval_path)
    cases = [
        _case(name, tmp_path, hf, {}, batches, eval_path, algo=DECOUPLED, mbs=4, build=build,
              grads_out=str(tmp_path / f"grads-{name}.pt"), **extra)
        for name, extra in (("padded", {}), ("packed", {"micro_batching": {"pack": True}}))
    ]  # fmt: skip
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    run_torchrun("tests.support.train_step_worker", [str(spec)], 1, timeout_s=240, log_path=tmp_path / "log.txt")
    return tuple(torch.load(c["out"]) for c in cases)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_packed_local_spec_bf16_attends_within_each_sequence(tiny_dir, tmp_path):
    """bf16 on the local spec (as LoRA builds it): the fused causal softmax would take the packed rows as one
    sequence each; unfused, the block mask holds and packed losses track the padded ones to bf16 precision."""
    padded, packed = _padded_and_packed(tiny_dir("qwen3_moe"), tmp_path, {"use_te": False, "dtype": "bfloat16"})
    for want, have in zip(padded["steps"], packed["steps"], strict=True):
        assert abs(want["loss"] - have["loss"]) <= 1e-2 * max(1.0, abs(want["loss"])), (want["loss"], have["loss"])
    assert packed["steps"][0]["batch/token_fill"] > padded["steps"][0]["batch/token_fill"]
