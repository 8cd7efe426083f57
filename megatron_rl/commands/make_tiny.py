"""`megatron-rl make-tiny`: write a small random Hugging Face checkpoint of a family (tests, demos)."""

from __future__ import annotations

import argparse

from megatron_rl.commands.args import add_json_flag
from megatron_rl.models import FAMILIES


def add_parser(sub) -> None:
    """Register `make-tiny`."""
    p = sub.add_parser("make-tiny", help="write a small random HF checkpoint of a family")
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    add_json_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict:
    """Create the checkpoint."""
    from megatron_rl.models.tiny import make_tiny  # torch and transformers: not for --help

    path = make_tiny(args.family, args.out, seed=args.seed, overwrite=args.overwrite)
    return {"family": args.family, "out": str(path), "seed": args.seed}
