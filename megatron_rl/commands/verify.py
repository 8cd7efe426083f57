"""`megatron-rl verify parity | sync | routing | sampling-mask | roundtrip`: checks of the trainer, the weight sync and conversions against
Hugging Face and the engines."""

from __future__ import annotations

import argparse

from megatron_rl.commands.args import (
    add_json_flag,
    add_layout_args,
    non_negative_int,
    positive_int,
    positive_number,
    probability,
)
from megatron_rl.parallel.layout import LayoutError, layout_from_config


def add_parser(sub) -> None:
    """Register `verify` and its checks."""
    p = sub.add_parser("verify", help="checks against Hugging Face and the engines")
    ver = p.add_subparsers(dest="what", required=True)
    q = ver.add_parser("parity", help="Megatron at a layout vs transformers on one token batch")
    q.add_argument("--hf", required=True)
    add_layout_args(q)
    q.add_argument("--mcore", default=None, help="load Megatron from this distributed checkpoint instead of --hf")
    q.add_argument(
        "--tolerance", type=positive_number, default=1e-4, help="max |logprob diff| that passes (exit 1 above)"
    )
    q.add_argument("--batch", type=positive_int, default=4)
    q.add_argument("--seq", type=positive_int, default=160)
    q.add_argument("--timeout", type=positive_number, default=900.0)
    add_json_flag(q)
    q.set_defaults(run=run_parity)
    q = ver.add_parser("sync", help="trainer -> changed weights -> bucketed sync to vLLM engines -> logprobs")
    q.add_argument("--hf", required=True)
    add_layout_args(q)
    q.add_argument("--engines", type=positive_int, default=2)
    q.add_argument("--engine-tp", type=sizes, default=[1], help="vLLM TP size, or one per engine: 1,2")
    q.add_argument(
        "--engine-ep",
        action="store_true",
        help="vLLM expert parallelism over each engine's tp x dp workers (each hosts 1/(tp*dp) of the experts); the"
        " sync sends each expert only to the workers that host it",
    )
    q.add_argument("--engine-dp", type=positive_int, default=1, help="vLLM data parallel size of each engine")
    q.add_argument(
        "--broadcast-experts",
        action="store_true",
        help="broadcast every expert to every engine worker, as for engines without expert parallelism (to compare)",
    )
    q.add_argument("--syncs", type=positive_int, default=1, help="successive syncs (versions 1..N)")
    q.add_argument("--bucket-mb", type=positive_number, default=64)
    q.add_argument("--inflight", choices=["keep", "abort"], default="keep", help="pause+resume or abort+continue")
    q.add_argument(
        "--inflight-requests", type=non_negative_int, default=0, help="generations in flight during each sync"
    )
    q.add_argument("--tolerance", type=positive_number, default=1e-3)
    q.add_argument("--timeout", type=positive_number, default=300.0)
    add_json_flag(q)
    q.set_defaults(run=run_sync)
    _add_routing(ver)
    _add_sampling_mask(ver)
    q = ver.add_parser("roundtrip", help="compare two HF checkpoints tensor by tensor")
    q.add_argument("first")
    q.add_argument("second")
    add_json_flag(q)
    q.set_defaults(run=run_roundtrip)


def _add_routing(ver) -> None:
    """`verify routing`'s arguments."""
    q = ver.add_parser(
        "routing", help="routing replay: a perturbed-router engine's routes replayed in the trainer at a layout"
    )
    q.add_argument("--hf", required=True)
    add_layout_args(q)
    q.add_argument("--engine-tp", type=positive_int, default=1, help="vLLM TP size of the engine")
    q.add_argument("--prompts", type=positive_int, default=4)
    q.add_argument("--prompt-len", type=positive_int, default=8)
    q.add_argument("--response-len", type=positive_int, default=24)
    q.add_argument("--temperature", type=positive_number, default=1.0)
    q.add_argument(
        "--perturb", type=positive_number, default=0.5,
        help="engine router selection bias per expert, in units of each token's router-logit std",
    )  # fmt: skip
    q.add_argument("--seed", type=non_negative_int, default=0)
    q.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="engine and trainer dtype")
    q.add_argument("--tolerance", type=positive_number, default=1e-5, help="max |logprob diff| with replay")
    q.add_argument("--timeout", type=positive_number, default=600.0)
    add_json_flag(q)
    q.set_defaults(run=run_routing)


def _add_sampling_mask(ver) -> None:
    """`verify sampling-mask`'s arguments."""
    q = ver.add_parser(
        "sampling-mask", help="top-k / top-p sampling: the trainer's masked logprobs against an engine's"
    )
    q.add_argument("--hf", required=True)
    add_layout_args(q)
    q.add_argument("--engine-tp", type=positive_int, default=1, help="vLLM TP size of the engine")
    q.add_argument("--top-k", type=positive_int, default=16)
    q.add_argument("--top-p", type=probability, default=0.9)
    q.add_argument("--temperature", type=positive_number, default=0.7)
    q.add_argument("--prompts", type=positive_int, default=4)
    q.add_argument("--prompt-len", type=positive_int, default=8)
    q.add_argument("--response-len", type=positive_int, default=24)
    q.add_argument("--seed", type=non_negative_int, default=0)
    q.add_argument("--tolerance", type=positive_number, default=1e-5, help="max |logprob diff| with the mask")
    q.add_argument("--timeout", type=positive_number, default=600.0)
    add_json_flag(q)
    q.set_defaults(run=run_sampling_mask)


def run_parity(args: argparse.Namespace) -> dict:
    """Megatron's logprobs at the layout against transformers'."""
    from megatron_rl.verify.parity import run_parity as parity  # torch, Megatron, transformers: not for --help

    report = parity(
        args.hf, layout_from_config(args), batch=args.batch, seq=args.seq, timeout_s=args.timeout,
        mcore_dir=args.mcore,
    )  # fmt: skip
    report["tolerance"] = args.tolerance
    report["passed"] = report["max_abs_logprob_diff"] <= args.tolerance
    return report


def run_sync(args: argparse.Namespace) -> dict:
    """Syncs from a trainer at the layout into running engines, then their logprobs against the trainer's."""
    from megatron_rl.verify.sync import run_sync_check  # Ray, vLLM, torch: not for --help

    tps = args.engine_tp
    if len(tps) > 1 and len(tps) != args.engines:
        raise LayoutError(f"--engine-tp {','.join(map(str, tps))}: {len(tps)} sizes for --engines {args.engines}")
    report = run_sync_check(
        args.hf, layout_from_config(args), engines=args.engines, engine_tp=tps if len(tps) > 1 else tps[0],
        engine_ep=args.engine_ep, engine_dp=args.engine_dp, owner_aware=not args.broadcast_experts, syncs=args.syncs, bucket_mb=args.bucket_mb, inflight=args.inflight,
        inflight_requests=args.inflight_requests, timeout_s=args.timeout,
    )  # fmt: skip
    report.pop("syncs", None)
    report["passed"] = report["max_abs_logprob_diff"] <= args.tolerance and report["version"] == args.syncs
    return report


def run_routing(args: argparse.Namespace) -> dict:
    """A perturbed-router engine's routes replayed in the trainer: agreement and logprobs with and without."""
    from megatron_rl.verify.routing import RoutingCheck, run_routing_check  # Ray, vLLM, torch: not for --help

    check = RoutingCheck(
        prompts=args.prompts, prompt_len=args.prompt_len, response_len=args.response_len,
        temperature=args.temperature, perturb=args.perturb, seed=args.seed, engine_tp=args.engine_tp,
        tolerance=args.tolerance, timeout_s=args.timeout, dtype=args.dtype,
    )  # fmt: skip
    return run_routing_check(args.hf, layout_from_config(args), check)


def run_sampling_mask(args: argparse.Namespace) -> dict:
    """An engine's top-k / top-p samples scored by the trainer with and without the sampling mask."""
    from megatron_rl.verify.sampling_mask import MaskCheck, run_sampling_mask_check  # Ray, vLLM: not for --help

    check = MaskCheck(
        top_k=args.top_k, top_p=args.top_p, temperature=args.temperature, prompts=args.prompts,
        prompt_len=args.prompt_len, response_len=args.response_len, seed=args.seed, engine_tp=args.engine_tp,
        tolerance=args.tolerance, timeout_s=args.timeout,
    )  # fmt: skip
    return run_sampling_mask_check(args.hf, layout_from_config(args), check)


def run_roundtrip(args: argparse.Namespace) -> dict:
    """Two HF checkpoints compared tensor by tensor."""
    from megatron_rl.verify.roundtrip import compare_hf_checkpoints  # torch, safetensors: not for --help

    return compare_hf_checkpoints(args.first, args.second)


def sizes(text: str) -> list[int]:
    """Parse `2` or `1,2` into positive sizes (an argparse type: a bad value is a usage error, not a traceback)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size or comma-separated sizes like 1,2") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be at least 1")
    return values
