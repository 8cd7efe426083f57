"""`megatron-rl config [CONFIG] [overrides] [--explain]`: the resolved config, or every field explained."""

from __future__ import annotations

import argparse

from megatron_rl.config import dump_config, explain, load_config


def add_parser(sub) -> None:
    """Register `config`."""
    p = sub.add_parser("config", help="print the resolved config (or --explain every field)")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*", help="dotted overrides such as trainer.parallel.ep=2")
    p.add_argument("--explain", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    """Print the config or the explanation."""
    if args.explain:
        print("\n".join(explain()))
        return
    print(dump_config(load_config(args.config, args.overrides)), end="")
