"""Surviving a dead engine: the launcher restarts it, the trainer re-forms its weight groups and re-syncs.

Launcher side, `EngineSupervisor`: the driver marks an engine down when its actor dies (its in-flight prompts are
requeued by the driver's workers); the supervisor replaces the actor (same name, same placement-group bundle,
vLLM started from the checkpoint on disk), publishes the new roster epoch on the run-control actor, and routes
prompts to it again once the trainer has brought it to the current weights.

Trainer side, `RecoveringSync`: every rank takes part in weight groups, so re-forming them is collective. Rank 0
watches the roster epoch and tells every rank (`resync`); a push that fails on any rank is retried once the
roster changed, and fails for good, naming the engine, when no restart comes within the sync timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time

from megatron_rl.rollout.control import CALL_TIMEOUT_S

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# Trainer side (every torchrun rank).


class RecoveringSync:
    """A `TrainerWeightSync` that follows the engine roster published on the run-control actor."""

    def __init__(self, sync, control, timeout_s: float):
        self.sync = sync
        self.control = control  # rank 0 only
        self.timeout_s = timeout_s
        self.epoch = 0
        self.resyncs = 0

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 talks to Ray."""
        return self.sync.is_coordinator

    def roster_changed(self) -> dict | None:
        """(Rank 0) the new roster when an engine was restarted since the last sync and none is down now."""
        import ray

        roster = ray.get(self.control.roster.remote(), timeout=60)
        if roster["epoch"] != self.epoch and not roster["down"]:
            return roster
        return None

    def resync(self, roster: dict, version: int) -> dict:
        """(Every rank, collectively) re-form the weight groups with the roster's engines and push `version`."""
        from megatron_rl.weights.sync import engine_handles

        self.sync.engines = engine_handles(roster["engines"], self.is_coordinator)
        self.sync.setup()
        self.epoch = roster["epoch"]
        self.resyncs += 1
        return self.sync.push(version)

    def push(self, version: int) -> dict:
        """Push `version`; if any rank failed (an engine died), wait for its restart, re-form and push again."""
        import torch.distributed as dist

        from megatron_rl.weights.sync import SyncError

        error: SyncError | None = None
        try:
            report = self.sync.push(version)
        except SyncError as err:
            error, report = err, {}
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else str(error))
        failed = [e for e in errors if e]
        if not failed:
            return report
        roster = [self._await_restart(failed[0])] if self.is_coordinator else [None]
        dist.broadcast_object_list(roster, src=0)
        return self.resync(roster[0], version) | {"recovered_from": failed[0]}

    def _await_restart(self, reason: str) -> dict:
        """(Rank 0) wait until the launcher restarted the dead engine(s); SyncError naming them after the timeout."""
        from megatron_rl.weights.sync import SyncError

        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            roster = self.roster_changed()
            if roster is not None:
                return roster
            time.sleep(0.5)
        raise SyncError(f"weight sync failed and no engine restart came within {self.timeout_s:.0f} s: {reason}")


# ---------------------------------------------------------------------------------------------------------------
# Launcher side (asyncio, next to the generation driver).


class EngineSupervisor:
    """Restarts engines the driver found dead, up to `max_restarts` each; see the module docstring."""

    def __init__(self, pool, driver, control, buffer, max_restarts: int, poll_s: float = 1.0):
        self.pool = pool
        self.driver = driver
        self.control = control
        self.buffer = buffer
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        self.restarts: dict[str, int] = {}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """End `run` after the current check."""
        self._stop.set()

    async def run(self) -> None:
        """Check for dead engines until stopped; raises when an engine died more often than allowed."""
        while not self._stop.is_set():
            for name, reason in list(self.driver.down.items()):
                await self._restart(name, reason)
            await asyncio.sleep(self.poll_s)

    async def _restart(self, name: str, reason: str) -> None:
        count = self.restarts.get(name, 0)
        if count >= self.max_restarts:
            raise RuntimeError(f"{name} died again ({reason}) after {count} restart(s) (rollout.max_engine_restarts)")
        self.restarts[name] = count + 1
        log.warning("%s is down (%s): restarting it (restart %d)", name, reason, count + 1)
        await asyncio.wait_for(self.control.engine_down.remote(name, reason), CALL_TIMEOUT_S)
        start = time.perf_counter()
        actor = await asyncio.get_running_loop().run_in_executor(None, self.pool.restart, name)
        await asyncio.wait_for(self.control.engine_restarted.remote(name), CALL_TIMEOUT_S)
        await self._until_current(name, actor)
        self.driver.bring_back(name, actor)
        log.warning("%s is back at the trainer's weights after %.1f s", name, time.perf_counter() - start)

    async def _until_current(self, name: str, actor) -> None:
        """Wait until the trainer synced the restarted engine (its version reached the trainer's)."""
        while not self._stop.is_set():
            trainer = (await asyncio.wait_for(self.buffer.stats.remote(), CALL_TIMEOUT_S))["trainer_version"]
            health = await asyncio.wait_for(actor.health.remote(), CALL_TIMEOUT_S)
            # Version 0 is the start-up checkpoint, which is what a trainer still at version 0 holds too.
            if health["version"] >= trainer and health["consistent"]:
                return
            await asyncio.sleep(self.poll_s)
