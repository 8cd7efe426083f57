"""Flags and argument types the commands share: the parallel layout, `--json`, positive numbers."""

from __future__ import annotations

import argparse
import math


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    """`--tp --pp --ep --etp --dp --first-stage-layers --last-stage-layers`, named as the `trainer.parallel`
    fields are, so that `parallel.layout.layout_from_config` reads the parsed flags as it reads that section."""
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=positive_int, default=1, help=f"{name.upper()} size (default 1)")
    parser.add_argument("--etp", type=positive_int, default=1, help="expert tensor parallel size (default 1)")
    parser.add_argument(
        "--dp", type=positive_int, default=None, help="data parallel size (default: smallest that fits)"
    )
    parser.add_argument(
        "--first-stage-layers",
        type=positive_int,
        default=None,
        help="layers on the first pipeline stage (default: even split)",
    )
    parser.add_argument(
        "--last-stage-layers",
        type=positive_int,
        default=None,
        help="layers on the last pipeline stage (default: even split)",
    )


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """`--json`: print the report as one JSON object."""
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a bad value is a usage error, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must not be negative")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (`nan`, `inf`, 0 and negatives are refused): seconds,
    tolerances, sizes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number above 0")
    return value


def probability(text: str) -> float:
    """An argparse type: a number in (0, 1] (top-p mass)."""
    value = positive_number(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a probability mass, at most 1")
    return value
