"""Surviving a dead engine, launcher side: `EngineSupervisor` restarts engines that died.

The driver marks an engine down when its actor dies under a request (its in-flight prompts are requeued by the
driver's workers), and the supervisor's own health probe catches engines that die while nothing is routed to
them, e.g. paused for a weight push while the driver waits at its staleness gate (without the probe the trainer
waited `sync.timeout_s` for a restart that never came). The supervisor replaces the actor (same name, same
placement-group bundle, vLLM started from the checkpoint on disk), publishes the new roster epoch on the
run-control actor, and routes prompts to it again once the trainer has brought it to the current weights (the
trainer side is `weights/recovery.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from megatron_rl.rollout.control import CALL_TIMEOUT_S
from megatron_rl.rollout.driver import ask_health, is_actor_death

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0
"""How long the supervisor's health probe waits for one engine before taking it as busy (not dead)."""


class EngineSupervisor:
    """Restarts engines the driver found dead, up to `max_restarts` each; see the module docstring."""

    def __init__(
        self,
        pool,
        driver,
        control,
        buffer,
        max_restarts: int,
        poll_s: float = 1.0,
        hang_timeout_s: float = 120.0,
        restart_timeout_s: float = 600.0,
    ):
        self.pool = pool
        self.driver = driver
        self.control = control
        self.buffer = buffer
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        self.hang_timeout_s = hang_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self._silent_since: dict[str, float] = {}
        """Engine -> when it last stopped answering probes (absent: it answered the last one)."""
        self.restarts: dict[str, int] = {}
        self.reasons: dict[str, list[str]] = {}
        """Why each engine was restarted, in order (a request's actor error, or the health probe's finding)."""
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """End `run` after the current check."""
        self._stop.set()

    async def run(self) -> None:
        """Restart dead engines until stopped; raises when an engine died more often than allowed.

        The health probe runs as its own task and each restart as another, so neither a slow engine nor a
        restart waiting for the trainer's re-sync keeps a second dead engine from being found and restarted
        (the trainer re-syncs only once no engine is down).
        """
        probing = asyncio.create_task(self._probe_until_stopped())
        restarts: dict[str, asyncio.Task] = {}
        try:
            while not self._stop.is_set():
                for task in (probing, *restarts.values()):
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                for name, reason in list(self.driver.down.items()):
                    if name not in restarts or restarts[name].done():  # still down after a bring-back: died again
                        restarts[name] = asyncio.create_task(self._restart(name, reason))
                await asyncio.sleep(self.poll_s)
        finally:
            for task in (probing, *restarts.values()):
                task.cancel()

    async def _probe_until_stopped(self) -> None:
        while not self._stop.is_set():
            await self.probe()
            await asyncio.sleep(self.poll_s)

    async def probe(self) -> list[str]:
        """Ask every engine the driver routes to for its health (all at once); mark the dead ones down; returns
        their names.

        Dead means the actor is gone (Ray answers at once with an actor error), vLLM inside it is (`alive`
        False), or it has answered no probe for `hang_timeout_s` (alive but silent: stopped or deadlocked; a busy
        engine still answers, its health is an async method). One slow answer is not death.
        """
        names = [name for name in self.driver.engines if name not in self.driver.down]
        answers = await asyncio.gather(*(ask_health(self.driver.engines[name], PROBE_TIMEOUT_S) for name in names))
        now = time.monotonic()
        found = []
        for name, (health, dead) in zip(names, answers):
            if dead is None and not health:  # no answer within the probe's timeout
                since = self._silent_since.setdefault(name, now)
                if now - since >= self.hang_timeout_s:
                    dead = f"hung: answered no health probe for {now - since:.0f} s (rollout.hang_timeout_s)"
            else:
                self._silent_since.pop(name, None)
            if dead is not None:
                self._silent_since.pop(name, None)
                self.driver.mark_down(name, f"health probe: {dead}")
                found.append(name)
        return found

    async def _restart(self, name: str, reason: str) -> None:
        count = self.restarts.get(name, 0)
        if count >= self.max_restarts:
            raise RuntimeError(f"{name} died again ({reason}) after {count} restart(s) (rollout.max_engine_restarts)")
        self.restarts[name] = count + 1
        self.reasons.setdefault(name, []).append(reason)
        log.warning("%s is down (%s): restarting it (restart %d)", name, reason, count + 1)
        await asyncio.wait_for(self.control.engine_down.remote(name, reason), CALL_TIMEOUT_S)
        start = time.perf_counter()
        restart = functools.partial(self.pool.restart, name, timeout_s=self.restart_timeout_s)
        actor = await asyncio.get_running_loop().run_in_executor(None, restart)
        await asyncio.wait_for(self.control.engine_restarted.remote(name), CALL_TIMEOUT_S)
        try:
            await self._until_current(name, actor)
        except Exception as err:
            if not is_actor_death(err):
                raise
            # Still down: `run` starts the next restart, within the same budget.
            self.driver.down[name] = f"died again before it was current: {type(err).__name__}"
            return
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
