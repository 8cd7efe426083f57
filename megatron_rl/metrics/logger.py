"""Where per-step metrics go: a live console line, `metrics.jsonl`, TensorBoard, and wandb when configured."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("loss/total", "loss", "{:+.4f}"),
    ("grad_norm", "|g|", "{:.3f}"),
    ("mismatch/abs_diff_mean", "mism", "{:.1e}"),
    ("is/weight_mean", "is", "{:.3f}"),
    ("staleness/mean", "stale", "{:.2f}"),
    ("time/trainer_idle_frac", "t-idle", "{:.2f}"),
    ("time/step_s", "step", "{:.2f}s"),
    ("sync/seconds", "sync", "{:.2f}s"),
)


def _flatten(prefix: str, value, out: dict) -> None:
    if isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{prefix}/{key}" if prefix else str(key), sub, out)
    else:
        out[prefix] = value


class MetricsLogger:
    """Writes one record per step to `metrics.jsonl` (always), TensorBoard (if installed) and wandb (if asked)."""

    def __init__(self, run_dir: str | Path, total_steps: int, wandb_project: str = "", config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.path = self.run_dir / "metrics.jsonl"
        self._jsonl = self.path.open("a")
        self._tb = _tensorboard(self.run_dir / "tb")
        self._wandb = _wandb(wandb_project, self.run_dir, config) if wandb_project else None
        self.start = time.perf_counter()

    def log(self, step: int, metrics: dict, kind: str = "", at: float | None = None) -> None:
        """Record the metrics of `step` everywhere and print the console line; a record of another `kind` (e.g.
        EVAL_RECORD: an evaluation that came with a later one) is marked so and has no console line. `at`: the
        `time.perf_counter()` the record's `wall_s` is for (default now; a step logged later passes its end)."""
        now = time.perf_counter() if at is None else at
        record = {"step": step, "wall_s": round(now - self.start, 3), **metrics}
        if kind:
            record[KIND_KEY] = kind
        self._jsonl.write(json.dumps(record, default=float) + "\n")
        self._jsonl.flush()
        flat: dict = {}
        _flatten("", metrics, flat)
        scalars = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            self._tb.write(step, scalars)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if not kind:
            print(self.console_line(step, flat), file=sys.stderr, flush=True)

    def console_line(self, step: int, flat: dict) -> str:
        """`[step 12/40 00:53] reward 0.812 | loss ...`: the live progress display."""
        elapsed = int(time.perf_counter() - self.start)
        parts = [f"[step {step}/{self.total_steps} {elapsed // 60:02d}:{elapsed % 60:02d}]"]
        for key, label, fmt in CONSOLE_KEYS:
            if isinstance(flat.get(key), (int, float)):
                parts.append(f"{label} {fmt.format(flat[key])}")
        return " | ".join(parts)

    def close(self) -> None:
        """Flush and close every sink."""
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _tensorboard(folder: Path) -> TensorBoardWriter | None:
    try:
        return TensorBoardWriter(folder)
    except ImportError:  # tensorboard is optional
        return None


class TensorBoardWriter:
    """TensorBoard's event file in `folder`, one event per step holding all the step's scalars: a writer call per
    scalar (`SummaryWriter.add_scalar`) costs an event, a queue hand-off and a pure-Python checksum each."""

    def __init__(self, folder: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2  # optional: only when tensorboard is installed
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # as above

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(str(folder))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Record `scalars` (tag -> value) at `step` and flush."""
        values = [self._summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def _wandb(project: str, run_dir: Path, config: dict | None):
    import wandb  # optional (the `wandb` extra), and only when a project is configured

    return wandb.init(project=project, dir=str(run_dir), config=config or {})


KIND_KEY = "record"
"""The key that marks a record other than a step's own (absent from step records)."""
EVAL_RECORD = "eval"
"""`record: eval`: an evaluation's results logged on their own (it came together with a later one)."""


def is_step_record(record: dict) -> bool:
    """Whether `record` is a step's own record (not one of another kind, see `MetricsLogger.log`)."""
    return KIND_KEY not in record


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a metrics.jsonl file. A last line without its newline is a record still being written
    (or torn by a crash) and is left out; a bad line anywhere else is an error naming the file and line."""
    text = Path(path).read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: incomplete
                break
            raise ValueError(f"{path}: line {number} is not a JSON record ({err})") from None
    return records
