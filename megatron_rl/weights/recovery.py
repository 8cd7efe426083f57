"""Surviving a dead engine, trainer side: every rank takes part in the weight groups, so re-forming them is
collective. Rank 0 watches the engine roster that the launcher publishes on the run-control actor (its epoch grows
with every engine restart, see `rollout/supervisor.py`) and tells every rank (`resync`); a push that fails on any
rank is retried once the roster changed, and fails for good, naming the engine, when no restart comes within the
time the launcher may take to find a dead or hung engine and restart it (`rollout.hang_timeout_s` +
`rollout.restart_timeout_s`).
"""

from __future__ import annotations

import time

import ray
import torch
import torch.distributed as dist

from megatron_rl.parallel.devices import compute_device
from megatron_rl.weights.sync import SyncError, engine_handles

RESTART_NEWS_S = 30.0
"""How often rank 0, waiting for an engine's restart, tells the other ranks it still waits (each broadcast then
waits far less than the trainer's collective timeout, which a restart may take longer than)."""
ROSTER_POLL_S = 1.0
"""How often rank 0 reads the roster between batches: a restarted engine waits up to this long for its weights (the
supervisor routes prompts to it only then), and a step need not pay a Ray call for it."""


class RecoveringSync:
    """A `TrainerWeightSync` that follows the engine roster published on the run-control actor."""

    def __init__(self, sync, control, timeout_s: float, poll_s: float = ROSTER_POLL_S, on_phase=None):
        self.sync = sync
        self.on_phase = on_phase or (lambda what: None)  # (rank 0) says what the trainer waits for: its heartbeat
        self.control = control  # rank 0 only
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.epoch = 0
        self.resyncs = 0
        self._read_at = -float("inf")

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 talks to Ray."""
        return self.sync.is_coordinator

    def roster_changed(self) -> dict | None:
        """(Rank 0) the new roster when an engine was restarted since the last sync and none is down now; None
        without asking within `poll_s` of the last read."""
        now = time.monotonic()
        if now - self._read_at < self.poll_s:
            return None
        self._read_at = now
        roster = ray.get(self.control.roster.remote(), timeout=60)
        if roster["epoch"] != self.epoch and not roster["down"]:
            return roster
        return None

    def resync(self, roster: dict, version: int) -> dict:
        """(Every rank, collectively) re-form the weight groups with the roster's engines and push `version`."""
        self.on_phase(f"re-forming the weight groups with restarted engines and pushing version {version}")
        self.sync.engines = engine_handles(roster["engines"], self.is_coordinator)
        self.sync.setup()
        self.epoch = roster["epoch"]
        self.resyncs += 1
        return self.sync.push(version)

    def push(self, version: int) -> dict:
        """Push `version`; if any rank failed (an engine died), wait for its restart, re-form and push again."""
        error: SyncError | None = None
        try:
            report = self.sync.push(version)
        except SyncError as err:
            error, report = err, {}
        # A one-number all-reduce on every push; the messages travel only when a rank failed.
        failures = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=compute_device())
        dist.all_reduce(failures)
        if not int(failures.item()):
            return report
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else str(error))
        failed = [e for e in errors if e]
        return self.resync(self._agree_on_restart(failed[0]), version) | {"recovered_from": failed[0]}

    def _agree_on_restart(self, reason: str) -> dict:
        """(Every rank) the roster with the restarted engine(s), from rank 0, which waits for it and tells the
        others every RESTART_NEWS_S that it still waits: their broadcasts never near the collective timeout, however
        long a restart may take. No restart within `timeout_s` (or rank 0's own error) is a SyncError on every
        rank, with rank 0's message."""
        deadline = time.monotonic() + self.timeout_s
        self.on_phase(f"waiting for an engine's restart ({reason})")
        while True:
            news = [self._restart_news(reason, deadline) if self.is_coordinator else None]
            dist.broadcast_object_list(news, src=0)
            kind, data = news[0]
            if kind == "roster":
                return data
            if kind == "error":
                raise SyncError(data)

    def _restart_news(self, reason: str, deadline: float) -> tuple[str, object]:
        """(Rank 0) ("roster", the new roster) once the restart came; ("waiting", None) after RESTART_NEWS_S
        without it; ("error", why) past the deadline or when reading the roster failed."""
        until = min(deadline, time.monotonic() + RESTART_NEWS_S)
        try:
            while time.monotonic() < until:
                roster = self.roster_changed()
                if roster is not None:
                    return "roster", roster
                time.sleep(0.5)
        except Exception as err:
            return "error", f"waiting for an engine restart: {type(err).__name__}: {err} (after: {reason})"
        if time.monotonic() < deadline:
            return "waiting", None
        return "error", f"weight sync failed and no engine restart came within {self.timeout_s:.0f} s: {reason}"
