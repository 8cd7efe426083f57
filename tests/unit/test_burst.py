"""The engine's burst gate (`rollout/burst.py`): the calls of one driver claim go on together."""

from __future__ import annotations

import asyncio
import time

from megatron_rl.rollout.burst import BurstGate, until_quiet


def _arrivals(gate: BurstGate, calls: list[tuple[int, int, float]]) -> list[float]:
    """Make each call (burst, size, arrival delay) and return when each got through, relative to the start."""

    async def one(burst: int, size: int, delay: float, start: float) -> float:
        await asyncio.sleep(delay)
        await gate.arrive(burst, size)
        return time.monotonic() - start

    async def run() -> list[float]:
        start = time.monotonic()
        return list(await asyncio.gather(*(one(b, n, d, start) for b, n, d in calls)))

    return asyncio.run(run())


def test_the_calls_of_a_burst_go_on_together_when_the_last_one_comes():
    gate = BurstGate(wait_s=5.0)
    through = _arrivals(gate, [(1, 3, 0.0), (1, 3, 0.05), (1, 3, 0.15)])
    assert min(through) >= 0.14 and max(through) - min(through) < 0.05  # held for the third, then all at once
    assert gate.pending() == 0


def test_a_burst_short_of_calls_is_let_go_after_the_wait_and_a_late_call_passes_at_once():
    gate = BurstGate(wait_s=0.1)
    through = _arrivals(gate, [(7, 3, 0.0), (7, 3, 0.02), (7, 3, 0.3)])
    assert 0.08 <= through[0] < 0.25 and 0.08 <= through[1] < 0.25  # the first one's wait let both go
    assert through[2] - 0.3 < 0.05  # the late call waits for nothing
    assert gate.pending() == 0


def test_single_calls_and_separate_bursts_do_not_wait_for_each_other():
    gate = BurstGate(wait_s=5.0)
    through = _arrivals(gate, [(1, 1, 0.0), (2, 2, 0.0), (3, 2, 0.1), (2, 2, 0.05), (3, 2, 0.2)])
    assert through[0] < 0.04  # a burst of one
    assert 0.04 <= through[1] < 0.1 and 0.04 <= through[3] < 0.1  # burst 2 when its second call came
    assert 0.19 <= through[2] < 0.26 and 0.19 <= through[4] < 0.26  # burst 3 when its own did


def _first_step_size(settle) -> int:
    """The engine actor's event loop in small: 8 group calls of one burst, each adding 8 requests once through the
    gate, and an idle engine core woken by the first add that runs `settle(count)` before its first step; how many
    requests that step starts with."""

    async def run() -> int:
        gate, added, work = BurstGate(wait_s=5.0), [0], asyncio.Event()

        async def group_call(delay: float) -> None:
            await asyncio.sleep(delay)
            await gate.arrive(7, 8)
            for _ in range(8):  # AsyncLLM adds each request without yielding
                added[0] += 1
                work.set()

        async def core() -> int:
            await work.wait()
            await settle(lambda: added[0])
            return added[0]

        step = asyncio.create_task(core())
        await asyncio.gather(*(group_call(0.001 * i) for i in range(8)))
        return await step

    return asyncio.run(run())


def test_an_idle_core_starts_with_every_request_of_the_burst():
    """The call that completes a burst goes on at once, the ones it releases a few loop iterations later: a core
    that stepped after one yield started with the last call's 8 requests alone (the engine then ran the other 56
    a step behind); waiting until the adds stop, it starts with all 64."""
    assert _first_step_size(lambda count: asyncio.sleep(0)) == 8
    assert _first_step_size(until_quiet) == 64


def test_until_quiet_returns_after_quiet_iterations_and_within_its_limit():
    async def run() -> tuple[int, int]:
        ticks = [0]

        async def ticker() -> None:
            for _ in range(100):
                ticks[0] += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        busy = await until_quiet(lambda: ticks[0], quiet=2, limit=16)  # something arrives every iteration
        task.cancel()
        return busy, await until_quiet(lambda: 0, quiet=2, limit=16)  # nothing arrives

    assert asyncio.run(run()) == (16, 2)
