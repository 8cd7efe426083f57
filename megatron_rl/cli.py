"""The `megatron-rl` command: one subcommand per module of `megatron_rl/commands/`.

Reports print as `key: value` lines, or as one JSON object with `--json`. An error whose message says it all
(`errors.UserError`: a bad config, checkpoint, layout, dataset...) prints as one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.commands import config as config_command
from megatron_rl.commands import convert, export, make_tiny, plan, report, train, verify
from megatron_rl.errors import UserError
from megatron_rl.rollout.ray_env import prefer_loopback_ray

COMMANDS = (make_tiny, convert, verify, config_command, plan, train, report, export)
"""Every subcommand's module, in the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments. A command's overrides may also follow its flags (`train c.yaml --overwrite
    steps=5`): argparse leaves those over, and they join the overrides given before the flags."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*(args.overrides or []), *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `megatron-rl` console script."""
    args = parse(argv)
    if not getattr(args, "ray_address", None):
        prefer_loopback_ray()  # a local Ray on loopback only: set before anything imports ray
    try:
        result = args.run(args)
    except (UserError, FileNotFoundError) as err:
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
