"""`megatron-rl report RUN_DIR`: redraw a run's `reward_curve.png` and `report.png` from its metrics (also mid-run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_rl.commands.args import add_json_flag
from megatron_rl.errors import UserError
from megatron_rl.metrics.logger import read_metrics


def add_parser(sub) -> None:
    """Register `report`."""
    p = sub.add_parser("report", help="redraw a run's reward curve and report.png from its metrics.jsonl")
    p.add_argument("run_dir", help="the run folder (output_dir/name), holding metrics.jsonl")
    add_json_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict:
    """Draw both pictures; returns their paths and the steps drawn."""
    from megatron_rl.metrics.plots import plot_report, plot_reward_curve  # matplotlib: not for --help

    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{metrics}: no such file (is {run_dir} a run folder? a run writes it from its first step)")
    try:
        steps = len(read_metrics(metrics))
    except ValueError as err:
        raise UserError(str(err)) from None
    return {
        "steps": steps,
        "reward_curve": str(plot_reward_curve(metrics, run_dir / "reward_curve.png", title=run_dir.name)),
        "report": str(plot_report(metrics, run_dir / "report.png", title=run_dir.name)),
    }
