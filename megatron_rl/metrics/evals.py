"""Trainer rank 0's side of evaluation: the launcher appends each evaluation's metrics to `RUN_DIR/eval.jsonl`
(see rollout/evaluation.py); each step record written next carries the oldest not yet logged, so `metrics.jsonl`
holds every one (`eval/version` says at which weights). The last step waits for the last evaluation; results
still queued then get records of their own at that step."""

from __future__ import annotations

import json
import time
from pathlib import Path

EVAL_FILE = "eval.jsonl"
"""The file in the run folder the launcher appends evaluation results to."""


class EvalInbox:
    """Reads the evaluation results that appear in a run's `eval.jsonl`, oldest first: each step record takes the
    oldest one not yet logged, so none is lost when two arrive between steps."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / EVAL_FILE
        self._offset = 0
        self.pending: list[dict] = []
        """Results read but not yet handed out, oldest first."""

    def _read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete, _, _ = chunk.rpartition("\n")  # a line being written has no newline yet
        self._offset += len(complete) + (1 if complete else 0)
        self.pending += [json.loads(line) for line in complete.splitlines() if line.strip()]

    def take(self) -> dict:
        """The oldest result not handed out yet ({} when none)."""
        self._read()
        return self.pending.pop(0) if self.pending else {}

    def drain_until(self, version: int, timeout_s: float, poll_s: float = 0.5) -> list[dict]:
        """Every result not handed out yet, oldest first, once the one of `version` is among them (waiting up to
        `timeout_s`); when it did not come, the last entry (or the only one) says `eval/missing: version`."""
        deadline = time.monotonic() + timeout_s
        self._read()
        while not any(r.get("eval/version") == version for r in self.pending):
            if time.monotonic() > deadline:
                results, self.pending = self.pending or [{}], []
                return [*results[:-1], {**results[-1], "eval/missing": version}]
            time.sleep(poll_s)
            self._read()
        results, self.pending = self.pending, []
        return results
