"""`megatron-rl convert hf-to-mcore | mcore-to-hf`: checkpoints between HF safetensors and Megatron's
distributed format, at any parallel layout."""

from __future__ import annotations

import argparse

from megatron_rl.commands.args import add_json_flag, add_layout_args, positive_number
from megatron_rl.parallel.layout import layout_from_config


def add_parser(sub) -> None:
    """Register `convert` and its two directions."""
    p = sub.add_parser("convert", help="convert checkpoints between HF safetensors and Megatron dist checkpoints")
    conv = p.add_subparsers(dest="direction", required=True)
    for direction, src in (("hf-to-mcore", "hf"), ("mcore-to-hf", "mcore")):
        q = conv.add_parser(direction)
        q.add_argument(f"--{src}", required=True, help="source checkpoint folder")
        q.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
        add_layout_args(q)
        q.add_argument("--overwrite", action="store_true")
        q.add_argument("--timeout", type=positive_number, default=3600.0, help="seconds before the workers are killed")
        add_json_flag(q)
        q.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict:
    """Convert in the direction asked."""
    from megatron_rl.weights import convert  # torch and Megatron: not for --help

    if args.direction == "hf-to-mcore":
        return convert.hf_to_mcore(
            args.hf, args.out, layout_from_config(args), overwrite=args.overwrite, timeout_s=args.timeout
        )
    return convert.mcore_to_hf(
        args.mcore, args.out, layout_from_config(args), overwrite=args.overwrite, timeout_s=args.timeout
    )
