"""The engine's burst gate (`rollout/burst.py`): the calls of one driver claim go on together."""

from __future__ import annotations

import asyncio
import time

from megatron_rl.rollout.burst import BurstGate


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
