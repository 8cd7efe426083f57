"""The launcher's engine supervisor against real Ray actors: an engine that dies while nothing is routed to it (as
when it is paused for a weight push and the driver waits at its staleness gate) is found by the health probe,
restarted and published on the run-control roster; a busy engine is not taken for dead."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from megatron_rl.config import RunConfig  # noqa: E402
from megatron_rl.rollout import supervisor as supervisor_module  # noqa: E402
from megatron_rl.rollout.buffer import make_buffer_actor  # noqa: E402
from megatron_rl.rollout.control import make_control_actor  # noqa: E402
from megatron_rl.rollout.driver import GenerationDriver  # noqa: E402
from megatron_rl.rollout.supervisor import EngineSupervisor  # noqa: E402


@ray.remote(num_cpus=0)
class IdleEngine:
    """An engine actor's health interface; `mode` says how it answers: healthy, vLLM dead, or too slowly."""

    def __init__(self, mode: str = "healthy"):
        self.mode = mode

    async def health(self, through_core: bool = False) -> dict:
        if self.mode == "slow":
            await asyncio.sleep(30)
        return {"alive": self.mode != "vllm_dead", "version": 0, "consistent": True}

    def pid(self) -> int:
        return os.getpid()


class RestartingPool:
    """What the supervisor needs of an EnginePool: `restart(name)` returns a fresh actor (no vLLM here; the
    real pool's restart is exercised by tests/e2e/test_faults.py)."""

    def __init__(self):
        self.restarted: list[str] = []

    def restart(self, name: str, timeout_s: float = 600.0):
        self.restarted.append(name)
        return IdleEngine.remote()


def _supervisor(engines: dict, **options) -> tuple[EngineSupervisor, GenerationDriver, RestartingPool, object]:
    driver = GenerationDriver(buffer=None, engines=engines, task=None, tokenizer=None, cfg=RunConfig(), lag=0)
    control = make_control_actor([(name, 1) for name in engines], name=f"control-{time.monotonic_ns()}")
    buffer = make_buffer_actor(capacity=4, max_staleness=1, stale_policy="drop")
    pool = RestartingPool()
    supervisor = EngineSupervisor(pool, driver, control, buffer, max_restarts=1, poll_s=0.2, **options)
    return supervisor, driver, pool, control


def test_an_engine_killed_while_idle_is_found_restarted_and_published(local_ray):
    engine, healthy = IdleEngine.remote(), IdleEngine.remote()
    supervisor, driver, pool, control = _supervisor({"engine-0": engine, "engine-1": healthy})
    os.kill(ray.get(engine.pid.remote(), timeout=30), signal.SIGKILL)

    async def scenario():
        task = asyncio.create_task(supervisor.run())
        deadline = time.monotonic() + 60
        while driver.stats.engine_restarts == 0 and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.2)
        supervisor.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert pool.restarted == ["engine-0"]
    assert supervisor.reasons["engine-0"][0].startswith("health probe: ")
    assert driver.down == {} and driver.engines["engine-0"] is not engine
    roster = ray.get(control.roster.remote(), timeout=30)
    assert roster["epoch"] == 1 and roster["restarts"] == {"engine-0": 1} and roster["down"] == {}
    assert ray.get(driver.engines["engine-0"].health.remote(), timeout=30)["alive"]


def test_probe_marks_a_dead_vllm_down_and_leaves_busy_engines_alone(local_ray, monkeypatch):
    monkeypatch.setattr(supervisor_module, "PROBE_TIMEOUT_S", 2.0)
    engines = {"dead": IdleEngine.remote("vllm_dead"), "ok": IdleEngine.remote()}
    engines.update({f"busy-{i}": IdleEngine.remote("slow") for i in range(3)})
    ray.get([actor.pid.remote() for actor in engines.values()], timeout=60)  # started: a probe times only answers
    supervisor, driver, _, _ = _supervisor(engines)
    start = time.monotonic()
    assert asyncio.run(supervisor.probe()) == ["dead"]
    # One round waits PROBE_TIMEOUT_S once, for all engines at once (one by one, three busy ones took 6 s).
    assert time.monotonic() - start < 2 * supervisor_module.PROBE_TIMEOUT_S
    assert driver.down == {"dead": "health probe: vLLM inside the actor is dead"}


def test_two_engines_dead_at_once_are_restarted_together(local_ray):
    """Restarts do not wait for each other: the trainer re-syncs only once no engine is down, so a second dead
    engine must not wait for the first one to be brought to the current weights."""
    engines = {"engine-0": IdleEngine.remote(), "engine-1": IdleEngine.remote()}
    pids = ray.get([actor.pid.remote() for actor in engines.values()], timeout=60)
    supervisor, driver, pool, control = _supervisor(engines)
    # The trainer is at version 3: a restarted engine (version 0) waits to be synced, which never comes here.
    ray.get(supervisor.buffer.set_trainer_version.remote(3), timeout=30)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    async def scenario():
        task = asyncio.create_task(supervisor.run())
        deadline = time.monotonic() + 60
        while len(pool.restarted) < 2 and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.2)
        supervisor.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert sorted(pool.restarted) == ["engine-0", "engine-1"]
    roster = ray.get(control.roster.remote(), timeout=30)
    assert roster["restarts"] == {"engine-0": 1, "engine-1": 1} and roster["down"] == {}
    assert driver.stats.engine_restarts == 0  # neither is routed to before the trainer synced it


def test_a_hung_engine_is_taken_for_dead_after_the_hang_timeout(local_ray, monkeypatch):
    """SIGSTOP: the actor is alive but answers nothing. A slow answer is not death; silence past
    rollout.hang_timeout_s is, and the engine is restarted with the reason logged."""
    monkeypatch.setattr(supervisor_module, "PROBE_TIMEOUT_S", 1.0)
    engine, healthy = IdleEngine.remote(), IdleEngine.remote()
    pid = ray.get(engine.pid.remote(), timeout=30)
    ray.get(healthy.pid.remote(), timeout=30)
    supervisor, driver, pool, control = _supervisor({"engine-0": engine, "engine-1": healthy}, hang_timeout_s=4.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert asyncio.run(supervisor.probe()) == []  # silent once: not yet dead
        assert driver.down == {}

        async def scenario():
            task = asyncio.create_task(supervisor.run())
            deadline = time.monotonic() + 60
            while driver.stats.engine_restarts == 0 and time.monotonic() < deadline and not task.done():
                await asyncio.sleep(0.2)
            supervisor.stop()
            await asyncio.wait_for(task, 30)

        started = time.monotonic()
        asyncio.run(scenario())
        assert time.monotonic() - started >= 2.0  # it waited for the hang timeout (4 s since the first silence)
        assert pool.restarted == ["engine-0"]
        assert supervisor.reasons["engine-0"][0].startswith("health probe: hung: answered no health probe for")
        assert "rollout.hang_timeout_s" in supervisor.reasons["engine-0"][0]
        assert ray.get(control.roster.remote(), timeout=30)["restarts"] == {"engine-0": 1}
    finally:
        os.kill(pid, signal.SIGKILL)
