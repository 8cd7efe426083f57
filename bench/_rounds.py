"""What the benchmarks that compare two ways of running a whole training run share: the steady state of a run's
metrics, and runs alternated mode by mode for `rounds` (so that a noisy machine's drift falls on both alike)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable

from megatron_rl.metrics.logger import read_metrics


def steady_state(metrics_path: str, skip: int) -> tuple[list[dict], float]:
    """(The records after the first `skip`, their wall seconds) of a run's metrics.jsonl."""
    records = read_metrics(metrics_path)
    if len(records) <= skip:
        raise SystemExit(f"{metrics_path}: {len(records)} steps, none after the {skip} start-up steps")
    return records[skip:], records[-1]["wall_s"] - records[skip - 1]["wall_s"]


def alternate(modes: tuple[str, ...], rounds: int, prefix: str, run: Callable[[str, str, str], dict]) -> dict:
    """`run(mode, root, name)` for every mode, `rounds` times, alternating, in one temporary folder; each mode's
    figures averaged over its rounds."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        for round_ in range(rounds):
            for mode in modes:
                runs[mode].append(run(mode, root, f"{mode}{round_}"))
    return {mode: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}


def rounds_parser(doc: str, steps: int) -> argparse.ArgumentParser:
    """The `--steps` and `--rounds` arguments both benchmarks take."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=1)
    return parser
