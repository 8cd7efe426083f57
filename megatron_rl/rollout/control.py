"""Run control: the small shared state between the launcher and the trainer's rank 0, as a Ray actor.

The launcher and the trainer are separate process trees (torchrun may even run on other nodes), so they meet
here: the trainer's rank 0 reports its progress (a heartbeat with the phase it is in, which the launcher's
`TrainerWatch` reads: a silent or stuck trainer is a failure), and the launcher publishes the engine roster, whose
epoch grows every time an engine is restarted, so the trainer knows to re-form its weight groups and bring the new
engine to the current weights.

The actor is not a single point of failure: Ray restarts it when its process dies (`make_control_actor`), the
calls made meanwhile are retried, and it comes back with the state it had, which it keeps in the Ray cluster's
key-value store (the GCS) after every change.
"""

from __future__ import annotations

import asyncio
import collections
import faulthandler
import json
import logging
import threading
import time
from typing import Any

import ray
from ray.experimental import internal_kv

from megatron_rl.rollout.ray_utils import NAMESPACE, on_this_node

log = logging.getLogger(__name__)

CONTROL_NAME = "run-control"
TRAINER_STATES = ("starting", "running", "done", "failed")
ENDED = ("done", "failed")
"""The trainer states after which no report changes the status."""
CALL_TIMEOUT_S = 60.0
"""Deadline of one call to the run's bookkeeping actors (run control, buffer), which answer at once unless gone."""
HEARTBEAT_S = 10.0
"""How often `TrainerHeartbeat` reports (from the trainer's start to its end)."""


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
    def report_trainer(self, state: str, step: int, message: str = "", phase_s: float = 0.0) -> None:
        """The trainer's rank 0 reports its state, last finished step and what it is doing (`message`) since
        `phase_s` seconds (its heartbeat). Once it reported the end (done or failed), later reports are ignored: a
        heartbeat sent as the trainer went down must not hide why."""
        if state not in TRAINER_STATES:
            raise ValueError(f"report_trainer: state={state!r} is not one of {TRAINER_STATES}")
        with self._lock:
            if self._trainer["state"] in ENDED:
                return
            self._trainer = {
                "state": state, "step": int(step), "message": message, "phase_s": float(phase_s), "time": time.time()
            }  # fmt: skip
            self._save()

    def report_failure(self, message: str) -> None:
        """The trainer's rank 0 is going down with `message` (its last finished step stays)."""
        with self._lock:
            self._trainer = {**self._trainer, "state": "failed", "message": message, "time": time.time()}
            self._save()

    def trainer_status(self) -> dict[str, Any]:
        """The last report, with `age_s`: seconds since it came, and `phase_s`: how long the trainer has been at
        what it reported (its report's figure plus `age_s`)."""
        with self._lock:
            age = time.time() - self._trainer["time"]
            return {**self._trainer, "age_s": age, "phase_s": self._trainer.get("phase_s", 0.0) + age}

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
    """(Trainer rank 0) the trainer's reports to run control, sent by a thread every `interval_s` for the trainer's
    whole life: its state, last finished step and the phase its main thread is in (start-up, waiting for a batch, a
    train step, a save, an export, a weight push) with how long it has been in it. The launcher's `TrainerWatch`
    reads them: silence means the process (or the Python in it) is gone, one phase longer than
    `trainer.stall_timeout_s` a stuck main thread. A long phase (a big checkpoint's load, a long step) is no
    silence. With no control actor (the other ranks) it does nothing.

    With `stall_s` (`trainer.stall_timeout_s`), the beat that may be the last one before the watch's verdict on a
    phase writes every thread's stack to stderr (the trainer's log) once, so the log says where the main thread is
    stuck, also where no one can signal the process (a trainer under Slurm)."""

    def __init__(self, control, interval_s: float = HEARTBEAT_S, stall_s: float | None = None):
        self.control, self.interval_s, self.stall_s = control, interval_s, stall_s
        self._lock = threading.Lock()
        self._report = ("starting", 0, "starting up")
        self._since = time.monotonic()
        self._dumped_since: float | None = None  # the phase whose stacks went out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TrainerHeartbeat:
        """Start the beats (rank 0); returns self."""
        if self.control is not None and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="trainer-heartbeat", daemon=True)
            self._thread.start()
        return self

    @property
    def state(self) -> str:
        """The state it reports (starting, running, ...)."""
        return self._report[0]

    def phase(self, step: int, what: str, state: str = "running") -> None:
        """The main thread is now at `what`, `step` the last finished step; the next beat says so (a phase of
        another name starts its clock again)."""
        if self.control is None:
            return
        with self._lock:
            if (state, what) != (self._report[0], self._report[2]):
                self._since = time.monotonic()
            self._report = (state, step, what)

    def stop(self, state: str | None = None, message: str = "") -> None:
        """End the beats; with `state`, report it (with the last step and `message`) as the last report."""
        if self.control is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CALL_TIMEOUT_S + 5)
        if state is not None:
            step = self._report[1]
            ray.get(self.control.report_trainer.remote(state, step, message), timeout=CALL_TIMEOUT_S)

    def _beat(self) -> None:
        while True:
            with self._lock:
                state, step, what = self._report
                since = self._since
                phase_s = time.monotonic() - since
            if self.stall_s is not None and phase_s + self.interval_s > self.stall_s and self._dumped_since != since:
                self._dumped_since = since
                self._dump_stacks(what, phase_s)
            try:
                ray.get(self.control.report_trainer.remote(state, step, what, phase_s), timeout=CALL_TIMEOUT_S)
            except Exception as err:  # a missed beat is the watch's to judge; the trainer's own work goes on
                log.warning("heartbeat to run control failed: %s: %s", type(err).__name__, err)
            if self._stop.wait(self.interval_s):
                return

    def _dump_stacks(self, what: str, phase_s: float) -> None:
        log.error(
            "rank 0 has been at %r for %.0f s, near trainer.stall_timeout_s (%g s): every thread's stack follows",
            what, phase_s, self.stall_s,
        )  # fmt: skip
        try:
            faulthandler.dump_traceback(all_threads=True)
        except (OSError, ValueError) as err:  # a stderr without a file descriptor: the beats matter more
            log.warning("could not write the stacks: %s: %s", type(err).__name__, err)


class TrainerWatch:
    """(The launcher) the trainer's reports to run control, read at most every `every_s`: it has ended when it
    says so (done or failed); it is lost when it has been silent longer than `silence_s` (counted from the last
    report that came, so a slow or failed call to run control only delays the verdict) or has stayed in one phase
    longer than `stall_s`."""

    def __init__(self, control, silence_s: float, stall_s: float, every_s: float = 2.0):
        self.control, self.silence_s, self.stall_s, self.every_s = control, silence_s, stall_s, every_s
        self.status: dict = {"state": "starting", "step": 0, "message": "", "age_s": 0.0, "phase_s": 0.0}
        self._heard = self._looked = time.monotonic()  # run control's first status is as old as the job

    async def look(self) -> dict:
        """The latest status (fetched when `every_s` has passed since the last look), with `age_s` and `phase_s`
        counted to now; a call that fails or takes longer than CALL_TIMEOUT_S is logged and leaves the last one."""
        now = time.monotonic()
        if now - self._looked >= self.every_s:
            self._looked = now
            try:
                status = await asyncio.wait_for(self.control.trainer_status.remote(), CALL_TIMEOUT_S)
            except Exception as err:
                log.warning("could not read the trainer's status from run control: %s: %s", type(err).__name__, err)
            else:
                self.status, self._heard = status, time.monotonic() - status["age_s"]
        since = time.monotonic() - self._heard
        return {**self.status, "phase_s": self.status["phase_s"] + since - self.status["age_s"], "age_s": since}

    def ended(self, status: dict) -> bool:
        """Whether the trainer reported its end."""
        return status["state"] in ENDED

    def lost(self, status: dict) -> str | None:
        """Why the trainer counts as lost (silent, or stuck in one phase), or None."""
        after = f"in state {status['state']!r} after step {status['step']}"
        if status["age_s"] > self.silence_s:
            return (
                f"trainer silent for {status['age_s']:.0f} s (> {self.silence_s:.0f} s, from trainer.timeout_s) "
                f"{after}, last at {status['message']!r}: is its torchrun job alive?"
            )
        if status["state"] not in ENDED and status["phase_s"] > self.stall_s:
            return (
                f"trainer stuck at {status['message']!r} for {status['phase_s']:.0f} s (> trainer.stall_timeout_s="
                f"{self.stall_s:.0f} s) {after}: its rank 0 still reports, but its main thread has not moved on"
            )
        return None
