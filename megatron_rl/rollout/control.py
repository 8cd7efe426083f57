"""Run control: the small shared state between the launcher and the trainer's rank 0, as a Ray actor.

The launcher and the trainer are separate process trees (torchrun may even run on other nodes), so they meet
here: the trainer reports its progress (a heartbeat the launcher watches, so a dead trainer is noticed within
`trainer.timeout_s`), and the launcher publishes the engine roster, whose epoch grows every time an engine is
restarted, so the trainer knows to re-form its weight groups and bring the new engine to the current weights.

The actor is not a single point of failure: Ray restarts it when its process dies (`make_control_actor`), the
calls made meanwhile are retried, and it comes back with the state it had, which it keeps in the Ray cluster's
key-value store (the GCS) after every change.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray.experimental import internal_kv

from megatron_rl.rollout.ray_utils import NAMESPACE, on_this_node

log = logging.getLogger(__name__)

CONTROL_NAME = "run-control"
TRAINER_STATES = ("starting", "running", "done", "failed")
CALL_TIMEOUT_S = 60.0
"""Deadline of one call to the run's bookkeeping actors (run control, buffer), which answer at once unless gone."""
HEARTBEAT_S = 10.0
"""How often `TrainerHeartbeat` reports while a long part of a step runs."""


class RunControl:
    """Trainer status and engine roster; every method is atomic (one lock). Inside a Ray actor, the state is
    saved to the cluster's key-value store after every change and restored when Ray restarts the actor."""

    def __init__(self, engines: list[tuple[str, int]]):
        self._lock = threading.Lock()
        self._engines = [(str(name), int(workers)) for name, workers in engines]
        self._epoch = 0
        self._restarts: collections.Counter[str] = collections.Counter()
        self._down: dict[str, str] = {}
        self._trainer: dict[str, Any] = {"state": "starting", "step": 0, "message": "", "time": time.time()}
        self._key = _state_key()
        if self._key is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            self._restore()

    def _save(self) -> None:
        """(Under the lock) keep the state where a restarted actor finds it."""
        if self._key is None:
            return
        state = {"epoch": self._epoch, "restarts": dict(self._restarts), "down": self._down, "trainer": self._trainer}
        internal_kv._internal_kv_put(self._key, json.dumps(state), namespace=NAMESPACE)

    def _restore(self) -> None:
        raw = internal_kv._internal_kv_get(self._key, namespace=NAMESPACE)
        if raw is None:
            return
        state = json.loads(raw)
        self._epoch, self._down, self._trainer = state["epoch"], state["down"], state["trainer"]
        self._restarts = collections.Counter(state["restarts"])
        log.warning("run control restarted by Ray: state restored (roster epoch %d)", self._epoch)

    # Trainer side.
    def report_trainer(self, state: str, step: int, message: str = "") -> None:
        """The trainer's rank 0 reports its state and last finished step (also its heartbeat)."""
        if state not in TRAINER_STATES:
            raise ValueError(f"report_trainer: state={state!r} is not one of {TRAINER_STATES}")
        with self._lock:
            self._trainer = {"state": state, "step": int(step), "message": message, "time": time.time()}
            self._save()

    def report_failure(self, message: str) -> None:
        """The trainer's rank 0 is going down with `message` (its last finished step stays)."""
        with self._lock:
            self._trainer = {**self._trainer, "state": "failed", "message": message, "time": time.time()}
            self._save()

    def trainer_status(self) -> dict[str, Any]:
        """The last report, with `age_s`: seconds since it came."""
        with self._lock:
            return {**self._trainer, "age_s": time.time() - self._trainer["time"]}

    # Launcher side.
    def engine_down(self, name: str, reason: str) -> None:
        """The launcher found engine `name` dead; it stays out of the roster's healthy set until restarted."""
        with self._lock:
            self._down[name] = reason
            self._save()

    def engine_restarted(self, name: str) -> int:
        """Engine `name` runs again (a new actor of the same name); the roster epoch grows; returns it."""
        with self._lock:
            self._down.pop(name, None)
            self._restarts[name] += 1
            self._epoch += 1
            self._save()
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


def _state_key() -> str | None:
    """Where this actor keeps its state in the cluster's key-value store (its actor id survives restarts), or
    None outside an actor."""
    if not ray.is_initialized():
        return None
    actor_id = ray.get_runtime_context().get_actor_id()
    return f"run-control/{actor_id}" if actor_id else None


def make_control_actor(engines: list[tuple[str, int]], name: str = CONTROL_NAME):
    """Start a `RunControl` as a named, threaded Ray actor that Ray restarts (with its state, and retrying the
    calls made meanwhile) whenever its process dies; returns its handle."""

    options = {
        "name": name, "num_cpus": 0, "max_concurrency": 16, "max_restarts": -1, "max_task_retries": -1,
        **on_this_node(),
    }  # fmt: skip
    return ray.remote(RunControl).options(**options).remote(engines)


class TrainerHeartbeat:
    """(Trainer rank 0) keeps the launcher's watchdog (`--external-trainer`: `trainer.timeout_s` of silence is a
    failure) fed while a long part of a step runs, a checkpoint save or a weight push and its recovery: a thread
    reports the trainer running every `interval_s` until the block ends. With no control actor (the other
    ranks) it does nothing."""

    def __init__(self, control, interval_s: float = HEARTBEAT_S):
        self.control, self.interval_s = control, interval_s

    @contextlib.contextmanager
    def during(self, step: int, what: str) -> Iterator[None]:
        """Report `what` as the trainer's message, at the start and every `interval_s`, while the block runs."""
        if self.control is None:
            yield
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._beat, args=(stop, step, what), name="trainer-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=CALL_TIMEOUT_S + 5)

    def _beat(self, stop: threading.Event, step: int, what: str) -> None:
        while True:
            try:
                ray.get(self.control.report_trainer.remote("running", step, what), timeout=CALL_TIMEOUT_S)
            except Exception as err:  # a missed beat is the watchdog's to judge; the block's own work goes on
                log.warning("heartbeat to run control failed: %s: %s", type(err).__name__, err)
            if stop.wait(self.interval_s):
                return
