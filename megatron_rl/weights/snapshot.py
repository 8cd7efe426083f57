"""Self-distillation's teacher, trainer side (`distill.teacher: snapshot`): the teacher engines get the policy's
weights through a weight sync of their own every `distill.refresh_every` steps, and hold them in between.

The teachers start from the policy's checkpoint (version 0). After step s with s a multiple of `refresh_every`,
every rank pushes the weights of version s to them (their weight version becomes s). A teacher that died is
restarted by the launcher's scorer from the checkpoint and scores nothing until it holds the weights it held
before (`rollout/teacher.py`); rank 0 sees the new actor under the same name and the refresh comes at once (while
the trainer waits for a batch, or after the step), with the current weights, to every teacher. A refresh that
fails (a teacher died during it) is tried again at the next step; it fails the run, naming the teacher, only after
`max_failures` tries in a row. Rank 0 decides and broadcasts, so every rank takes part in the same collectives.
"""

from __future__ import annotations

import logging

import ray
import torch.distributed as dist

from megatron_rl.weights.sync import SyncError, TrainerWeightSync, engine_handles

log = logging.getLogger(__name__)

READY_POLL_S = 5.0
"""How long one look at a restarted teacher waits for its vLLM to have started (it is asked again later)."""


class SnapshotTeachers:
    """The teacher engines' weight sync and when it runs (module docstring). Construct on every rank."""

    def __init__(self, sync: TrainerWeightSync, refresh_every: int, max_failures: int = 3):
        self.sync = sync
        self.refresh_every = refresh_every
        self.max_failures = max_failures
        self.version = 0
        """The policy version the teachers hold (the step of the last refresh)."""
        self.refreshes = 0
        self.failures = 0
        """Refreshes that failed in a row."""
        self._ids: dict[str, str] = {}
        """(Rank 0) each teacher's actor id when its weight group was formed: a new one means a restart."""
        self._pending = False
        """(Rank 0) a refresh is owed: it failed, or a teacher was not back yet when it was due."""

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 talks to Ray."""
        return self.sync.is_coordinator

    def setup(self) -> None:
        """(Every rank) form the teachers' weight groups."""
        self.sync.setup()
        if self.is_coordinator:
            self._ids = {h.name: h.actor._actor_id.hex() for h in self.sync.engines}

    def restarted(self) -> bool:
        """(Rank 0) whether a teacher's actor is not the one its weight group was formed with (a restart)."""
        for handle in self.sync.engines:
            try:
                actor = ray.get_actor(handle.name)
            except ValueError:  # being restarted: its name is free for a moment
                return True
            if actor._actor_id.hex() != self._ids.get(handle.name):
                return True
        return False

    def plan(self, step: int, due: bool) -> dict | None:
        """(Rank 0) what to do now: None, or {"reform": whether the weight groups must be formed anew first}.
        A refresh is due after a multiple of `refresh_every`, owed after a failure, and brought forward by a
        restart; it waits while a teacher is not back (its actor missing or not started)."""
        reform = self._pending or self.restarted()
        if not (due or reform):
            return None
        if reform and not self._all_ready():
            self._pending = True
            return None
        return {"reform": reform}

    def _all_ready(self) -> bool:
        """(Rank 0) whether every teacher's actor exists and its vLLM has started; asks for at most
        `READY_POLL_S`, so that the trainer's wait for a batch goes on polling while a teacher starts."""
        try:
            handles = engine_handles([(h.name, h.workers) for h in self.sync.engines], True)
            futures = [h.actor.ready.remote(READY_POLL_S) for h in handles]
            ray.get(futures, timeout=READY_POLL_S + 5)
        except Exception as err:  # a teacher still being restarted: the next poll tries again
            log.info("teacher refresh waits for the teachers: %s", err)
            return False
        return True

    def after_step(self, step: int) -> dict:
        """(Every rank, collectively) refresh the teachers when due (or owed); the step's teacher metrics."""
        due = bool(self.refresh_every) and step % self.refresh_every == 0
        box = [self.plan(step, due) if self.is_coordinator else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            self.refresh(box[0], step)
        return {
            "distill/teacher_refreshes": self.refreshes,
            "distill/teacher_weights_version": self.version,
            # Rank 0's view (it plans): a due refresh deferred while a teacher restarts, or a failed one.
            "distill/teacher_refresh_owed": float(self._pending),
        }

    def refresh(self, plan: dict, step: int) -> None:
        """(Every rank, collectively) push the current weights to the teachers as version `step` (forming the
        weight groups anew first when `plan["reform"]`); a failure is retried later, up to `max_failures`."""
        error = None
        try:
            if plan["reform"]:
                self.sync.engines = engine_handles(
                    [(h.name, h.workers) for h in self.sync.engines], self.is_coordinator
                )
                self.setup()
            self.sync.push(step)
        except SyncError as err:
            error = str(err)
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [e for e in errors if e]
        if not failed:
            self.version, self.refreshes, self.failures, self._pending = step, self.refreshes + 1, 0, False
            return
        self.failures += 1
        self._pending = True
        if self.failures >= self.max_failures:
            raise SyncError(f"refreshing the snapshot teachers failed {self.failures} times in a row: {failed[0]}")
        log.warning("refreshing the snapshot teachers to version %d failed (%s); trying again", step, failed[0])
