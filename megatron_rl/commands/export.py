"""`megatron-rl export RUN_OR_CHECKPOINT_DIR --out DIR`: a saved policy as a Hugging Face checkpoint folder.

The source is a run folder (`output_dir/name`: its `checkpoint.save_dir` is read from its `config.yaml`), a
checkpoint folder (`save_dir`, holding `latest` and `step_*`), or one step's checkpoint; `--step` picks a step.
The conversion is `convert mcore-to-hf`'s (the same gather), at the layout the flags give (default 1x1x1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_rl.commands.args import add_json_flag, add_layout_args, positive_int, positive_number
from megatron_rl.config import load_config
from megatron_rl.errors import UserError
from megatron_rl.parallel.layout import layout_from_config
from megatron_rl.run_state import latest_checkpoint, step_dir

CHECKPOINT_META = "megatron_rl.json"
"""The file every Megatron checkpoint of this project holds (see trainer/checkpoint.py)."""


def add_parser(sub) -> None:
    """Register `export`."""
    p = sub.add_parser("export", help="a run's saved policy (any step) as a Hugging Face checkpoint folder")
    p.add_argument("source", help="a run folder, its checkpoint.save_dir, or one step's checkpoint folder")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    p.add_argument(
        "--step", type=positive_int, default=None, help="the step to export (default: the latest checkpoint)"
    )
    add_layout_args(p)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--timeout", type=positive_number, default=3600.0, help="seconds before the workers are killed")
    add_json_flag(p)
    p.set_defaults(run=run)


def checkpoint_of(source: str | Path, step: int | None = None) -> Path:
    """The step checkpoint folder that `source` (a run folder, a save_dir or a step checkpoint) names."""
    source = Path(source)
    if (source / CHECKPOINT_META).is_file():
        if step is not None:
            raise UserError(f"{source} is one step's checkpoint: --step {step} does not apply")
        return source
    if (source / "config.yaml").is_file() and not (source / "latest").exists():
        save_dir = load_config(source / "config.yaml").checkpoint.save_dir
        if not save_dir:
            raise UserError(
                f"{source}: the run saved no checkpoints (checkpoint.save_dir is empty); its final policy is "
                f"exported in {source / 'hf'}"
            )
        source = Path(save_dir)
    if step is not None:
        folder = step_dir(source, step)
        if not (folder / CHECKPOINT_META).is_file():
            raise UserError(f"{folder}: no checkpoint of step {step} there")
        return folder
    folder = latest_checkpoint(source) if source.is_dir() else None
    if folder is None:
        raise UserError(f"{source}: neither a run folder, a checkpoint folder (with `latest`) nor a step's checkpoint")
    return folder


def run(args: argparse.Namespace) -> dict:
    """Export the checkpoint; returns the conversion's report with the step it came from."""
    from megatron_rl.weights.convert import mcore_to_hf  # torch and Megatron: not for --help

    folder = checkpoint_of(args.source, args.step)
    report = mcore_to_hf(
        str(folder), args.out, layout_from_config(args), overwrite=args.overwrite, timeout_s=args.timeout
    )
    return {"checkpoint": str(folder), **report}
