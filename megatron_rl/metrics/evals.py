"""Trainer rank 0's side of evaluation: the launcher appends each evaluation's metrics to `RUN_DIR/eval.jsonl`
(see rollout/evaluation.py); the step record written next carries the newest of them, so `metrics.jsonl` holds
them at the interval they were taken (`eval/version` says at which weights). The last step waits for the last
evaluation."""

from __future__ import annotations

import json
import time
from pathlib import Path

EVAL_FILE = "eval.jsonl"
"""The file in the run folder the launcher appends evaluation results to."""


class EvalInbox:
    """Reads the evaluation results that appear in a run's `eval.jsonl`."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / EVAL_FILE
        self._offset = 0
        self.seen: list[dict] = []

    def take(self) -> dict:
        """The newest result written since the last call ({} when none)."""
        if not self.path.exists():
            return {}
        with self.path.open() as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete, _, _ = chunk.rpartition("\n")  # a line being written has no newline yet
        self._offset += len(complete) + (1 if complete else 0)
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.seen += new
        return new[-1] if new else {}

    def wait_for(self, version: int, timeout_s: float, poll_s: float = 0.5) -> dict:
        """The result of the evaluation at `version` (and any written before it), waiting up to `timeout_s`;
        {"eval/missing": version} when it did not come."""
        deadline = time.monotonic() + timeout_s
        latest = self.take()
        while latest.get("eval/version") != version and not any(r.get("eval/version") == version for r in self.seen):
            if time.monotonic() > deadline:
                return {**latest, "eval/missing": version}
            time.sleep(poll_s)
            latest = self.take() or latest
        return next(r for r in reversed(self.seen) if r.get("eval/version") == version)
