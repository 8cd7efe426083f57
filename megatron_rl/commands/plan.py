"""`megatron-rl plan CONFIG`: per-GPU memory of a config's trainer and engines on its cluster."""

from __future__ import annotations

import argparse

from megatron_rl.commands.args import add_json_flag
from megatron_rl.config import load_config


def add_parser(sub) -> None:
    """Register `plan`."""
    p = sub.add_parser("plan", help="per-GPU memory of a config's trainer and engines on its cluster")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as trainer.parallel.pp=8 cluster.gpu=h200")
    add_json_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict | None:
    """Plan the config; print the table (or return the plan for --json)."""
    from megatron_rl.planner import format_plan, plan  # the model families' parameter maps

    result = plan(load_config(args.config, args.overrides))
    if args.json:
        return result.to_dict()
    print(format_plan(result))
    return None
