"""The parallel-layout flags shared by the commands that launch torchrun workers."""

from __future__ import annotations

import argparse


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    """`--tp --pp --ep --etp --dp --first-stage-layers --last-stage-layers`, named as the `trainer.parallel`
    fields are, so that `parallel.layout.layout_from_config` reads the parsed flags as it reads that section."""
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


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """`--json`: print the report as one JSON object."""
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
