"""The launcher's console: one prefixed line per event and per training step; everything else to log files.

`megatron-rl train` shows only lines that start with `PREFIX`: what it starts, one line per step (reward, eval
score, staleness, train-vs-rollout mismatch, reverse KL to a teacher, tokens/s, sync seconds, ETA), warnings of
this project, and the end. Third-party output goes to files under `RUN_DIR/logs/`: Python logging and warnings of
the launcher process (Ray, vLLM, Megatron) to `launcher.log`, the trainer ranks' output to `trainer.log`, the
engines' to `engine-*.log` (copied from Ray's own worker logs). With `--verbose` everything is shown as it comes.

The step lines are read from `metrics.jsonl` (which trainer rank 0 writes), so they work the same when the trainer
runs elsewhere (`--external-trainer`, on a shared filesystem).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
from pathlib import Path
from typing import TextIO

from megatron_rl.metrics.logger import is_step_record

PREFIX = "[megatron-rl]"
"""Every line this project prints on the console of a run starts with it."""
LOGS_DIR = "logs"
"""Folder of a run with the launcher's, trainer's and engines' logs."""
STEP_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/reward_mean", "eval", "{:.3f}"),
    ("staleness/mean", "stale", "{:.1f}"),
    ("mismatch/k3_kl", "mism", "{:.1e}"),
    ("distill/reverse_kl", "kl", "{:.3f}"),
    ("throughput/trained_tokens_per_s", "tok/s", "{:.0f}"),
    ("sync/seconds", "sync", "{:.2f}s"),
)
"""(metric, label, format) of a step line, in order; a metric a step does not have is left out."""


class Console:
    """Prefixed lines on the console (stderr by default)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream

    def say(self, text: str) -> None:
        """Print one line (or several, each prefixed)."""
        stream = self.stream or sys.stderr
        for line in str(text).splitlines() or [""]:
            print(f"{PREFIX} {line}", file=stream, flush=True)


def step_line(record: dict, total_steps: int, eta_s: float | None) -> str:
    """`step 12/50 | reward 0.812 | stale 2.1 | ... | ETA 0:32` for one metrics record."""
    parts = [f"step {record['step']}/{total_steps}"]
    for key, label, fmt in STEP_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{label} {fmt.format(value)}")
    if eta_s is not None:
        minutes, seconds = divmod(int(round(eta_s)), 60)
        parts.append(f"ETA {minutes}:{seconds:02d}")
    return " | ".join(parts)


class MetricsFollower:
    """Prints a step line for every record that appears in a run's `metrics.jsonl`."""

    def __init__(self, path: Path, total_steps: int, console: Console):
        self.path, self.total_steps, self.console = path, total_steps, console
        self._offset = 0
        self._times: list[tuple[int, float]] = []  # (step, wall_s) of the records seen, for the ETA

    def poll(self) -> list[dict]:
        """Read the complete lines written since the last call, print one line each, return their records."""
        if not self.path.exists():
            return []
        with self.path.open() as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete, _, _ = chunk.rpartition("\n")  # a line being written has no newline yet
        self._offset += len(complete) + (1 if complete else 0)
        records = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a record torn by a crash: the trainer's own log says why
            records.append(record)
            if not is_step_record(record):
                continue  # an evaluation on its own: the launcher printed its line when it finished
            self._times.append((int(record["step"]), float(record.get("wall_s", 0.0))))
            self.console.say(step_line(record, self.total_steps, self.eta_s()))
        return records

    def eta_s(self) -> float | None:
        """Seconds to the last step at the pace of the last (up to) 10 steps; None before two steps."""
        recent = self._times[-11:]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return None
        pace = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        return max(0.0, (self.total_steps - recent[-1][0]) * pace)


class ThirdPartyOutput:
    """Routes the launcher process's Python logging and warnings to `RUN_DIR/logs/launcher.log`.

    Set up before the heavy imports (which already warn), it buffers in memory until `to_file` names the file;
    this project's own warnings also reach the console, prefixed. With `verbose` nothing is redirected.
    """

    def __init__(self, console: Console, verbose: bool = False):
        self.console, self.verbose = console, verbose
        self.buffer = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
        self.file_handler: logging.Handler | None = None
        if verbose:
            return
        logging.captureWarnings(True)
        root = logging.getLogger()
        root.handlers = [self.buffer]
        root.setLevel(logging.INFO)
        ours = logging.getLogger("megatron_rl")
        ours.addHandler(_ConsoleHandler(console))

    def to_file(self, log_dir: Path) -> Path:
        """Write everything so far, and all that follows, to `log_dir/launcher.log`; take over loggers that
        third-party packages (Ray, vLLM) gave stream handlers of their own."""
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "launcher.log"
        if self.verbose:
            return path
        self.file_handler = logging.FileHandler(path)
        self.file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.buffer.setTarget(self.file_handler)
        self.buffer.flush()
        root = logging.getLogger()
        root.handlers = [self.file_handler]
        for name in list(logging.root.manager.loggerDict):
            logger = logging.getLogger(name)
            if name.split(".")[0] in ("ray", "vllm", "megatron", "torch", "transformers") and logger.handlers:
                logger.handlers = [self.file_handler]
        return path


class _ConsoleHandler(logging.Handler):
    """This project's warnings and errors on the console, prefixed (also logged to the file by the root)."""

    def __init__(self, console: Console):
        super().__init__(level=logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.say(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # a console that cannot print must not stop the run
            self.handleError(record)


def collect_ray_logs(ray_temp_dir: str | Path | None, engine_names: dict[int, str], log_dir: Path) -> list[Path]:
    """Copy the Ray worker logs of a local Ray session into `log_dir`: each engine's (where vLLM and its
    subprocesses write) as `<engine name>.log`, or `engine-pid<N>.log` for a process that no longer serves (a
    restarted engine's), and the run's other actors as `<actor class>-pid<N>.log`."""
    logs = Path(ray_temp_dir) / "session_latest" / "logs" if ray_temp_dir else None
    if logs is None or not logs.is_dir():
        return []
    log_dir.mkdir(parents=True, exist_ok=True)
    sections: dict[Path, list[str]] = {}
    for file in sorted(logs.glob("worker-*.out")) + sorted(logs.glob("worker-*.err")):
        text = file.read_text(errors="replace")
        actor = next((ln.split(":", 2)[2] for ln in text.splitlines()[:3] if ln.startswith(":actor_name:")), None)
        pid = int(file.stem.rsplit("-", 1)[-1])
        if actor is None:  # a task worker, or one that never ran anything
            continue
        if actor == "VLLMEngine":
            name = engine_names.get(pid, f"engine-pid{pid}")
        else:
            name = f"{actor}-pid{pid}"
        sections.setdefault(log_dir / f"{name}.log", []).append(f"===== {file.name} =====\n{text}")
    for target, parts in sections.items():
        target.write_text("\n".join(parts))
    return sorted(sections)
