"""Runs `megatron-rl train` (the CLI's `main`, in this one process) once per argument list and prints, as one JSON
list, each run's exit code and what it wrote to stderr: many start-up errors for the price of one import.

Usage: python -m tests.support.train_errors CASES.json, where CASES.json holds a list of argument lists (each
without the leading `train`).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from megatron_rl.cli import main


def run(args: list[str]) -> dict:
    """Exit code and stderr of `megatron-rl train ARGS`."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["train", *args])
        except SystemExit as exit_:  # argparse exits on bad arguments
            code = exit_.code
    return {"args": args, "code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps([run(args) for args in cases]))
