"""Run control: the small shared state between the launcher and the trainer's rank 0, as a Ray actor.

The launcher and the trainer are separate process trees (torchrun may even run on other nodes), so they meet
here: the trainer reports its progress (a heartbeat the launcher watches, so a dead trainer is noticed within
`trainer.timeout_s`), and the launcher publishes the engine roster, whose epoch grows every time an engine is
restarted, so the trainer knows to re-form its weight groups and bring the new engine to the current weights.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import ray

from megatron_rl.rollout.ray_utils import on_this_node

CONTROL_NAME = "run-control"
TRAINER_STATES = ("starting", "running", "done", "failed")
CALL_TIMEOUT_S = 60.0
"""Deadline of one call to the run's bookkeeping actors (run control, buffer), which answer at once unless gone."""


class RunControl:
    """Trainer status and engine roster; every method is atomic (one lock)."""

    def __init__(self, engines: list[tuple[str, int]]):
        self._lock = threading.Lock()
        self._engines = [(str(name), int(workers)) for name, workers in engines]
        self._epoch = 0
        self._restarts: collections.Counter[str] = collections.Counter()
        self._down: dict[str, str] = {}
        self._trainer: dict[str, Any] = {"state": "starting", "step": 0, "message": "", "time": time.time()}

    # Trainer side.
    def report_trainer(self, state: str, step: int, message: str = "") -> None:
        """The trainer's rank 0 reports its state and last finished step (also its heartbeat)."""
        if state not in TRAINER_STATES:
            raise ValueError(f"report_trainer: state={state!r} is not one of {TRAINER_STATES}")
        with self._lock:
            self._trainer = {"state": state, "step": int(step), "message": message, "time": time.time()}

    def report_failure(self, message: str) -> None:
        """The trainer's rank 0 is going down with `message` (its last finished step stays)."""
        with self._lock:
            self._trainer = {**self._trainer, "state": "failed", "message": message, "time": time.time()}

    def trainer_status(self) -> dict[str, Any]:
        """The last report, with `age_s`: seconds since it came."""
        with self._lock:
            return {**self._trainer, "age_s": time.time() - self._trainer["time"]}

    # Launcher side.
    def engine_down(self, name: str, reason: str) -> None:
        """The launcher found engine `name` dead; it stays out of the roster's healthy set until restarted."""
        with self._lock:
            self._down[name] = reason

    def engine_restarted(self, name: str) -> int:
        """Engine `name` runs again (a new actor of the same name); the roster epoch grows; returns it."""
        with self._lock:
            self._down.pop(name, None)
            self._restarts[name] += 1
            self._epoch += 1
            return self._epoch

    def roster(self) -> dict[str, Any]:
        """Engines (name, workers), the epoch, engines currently down and restarts per engine."""
        with self._lock:
            return {
                "epoch": self._epoch,
                "engines": [list(e) for e in self._engines],
                "down": dict(self._down),
                "restarts": dict(self._restarts),
            }


def make_control_actor(engines: list[tuple[str, int]], name: str = CONTROL_NAME):
    """Start a `RunControl` as a named, threaded Ray actor; returns its handle."""

    options = {"name": name, "num_cpus": 0, "max_concurrency": 16, **on_this_node()}
    return ray.remote(RunControl).options(**options).remote(engines)
