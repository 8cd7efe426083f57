"""A driver burst's calls made as one (`rollout/burst.py`): the batcher, the engine's per-group outcomes, and the
in-process core's wait for a burst's requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_rl.rollout.burst import CallBatcher, generate_groups, portable_error, until_quiet


class Recorder:
    """A burst call that answers each item doubled, recording each call's items and when it was made."""

    def __init__(self, start: float, fail: Exception | None = None):
        self.start, self.fail, self.calls = start, fail, []

    async def __call__(self, items: list) -> list:
        self.calls.append((sorted(items), round(time.monotonic() - self.start, 2)))
        if self.fail is not None:
            raise self.fail
        return [2 * item for item in items]


def _members(batcher: CallBatcher, members: list[tuple], fail: Exception | None = None) -> tuple[list, list]:
    """Run members (key, size, item or None to withdraw, arrival delay) against one recorder; (each member's
    outcome or error, the calls made)."""

    async def member(key, size, item, delay, call):
        await asyncio.sleep(delay)
        if item is None:
            batcher.withdraw(key, size)
            return "withdrawn"
        try:
            return await batcher.submit(key, size, item, call)
        except Exception as err:
            return err

    async def run():
        call = Recorder(time.monotonic(), fail)
        outcomes = await asyncio.gather(*(member(*m, call) for m in members))
        return list(outcomes), call.calls

    return asyncio.run(run())


def test_a_burst_makes_one_call_when_its_last_member_comes_and_each_gets_its_own_outcome():
    batcher = CallBatcher(wait_s=5.0)
    outcomes, calls = _members(batcher, [("b", 3, 1, 0.0), ("b", 3, 2, 0.05), ("b", 3, 3, 0.15)])
    assert outcomes == [2, 4, 6]
    assert len(calls) == 1 and calls[0][0] == [1, 2, 3] and 0.14 <= calls[0][1] < 0.3
    assert batcher.pending() == 0


def test_a_burst_short_of_members_goes_after_the_wait_and_a_late_member_goes_alone_at_once():
    batcher = CallBatcher(wait_s=0.1)
    outcomes, calls = _members(batcher, [("b", 3, 1, 0.0), ("b", 3, 2, 0.02), ("b", 3, 3, 0.3)])
    assert outcomes == [2, 4, 6]
    assert [items for items, _ in calls] == [[1, 2], [3]]
    assert 0.08 <= calls[0][1] < 0.25 and 0.3 <= calls[1][1] < 0.35


def test_a_withdrawn_member_is_not_waited_for_and_separate_bursts_do_not_mix():
    batcher = CallBatcher(wait_s=5.0)
    members = [("a", 3, 1, 0.0), ("b", 2, 10, 0.0), ("a", 3, None, 0.05), ("a", 3, 2, 0.1), ("b", 2, 20, 0.2)]
    outcomes, calls = _members(batcher, members)
    assert outcomes == [2, 20, "withdrawn", 4, 40]
    assert calls[0][0] == [1, 2] and 0.09 <= calls[0][1] < 0.15  # burst a once its third member withdrew
    assert calls[1][0] == [10, 20] and 0.19 <= calls[1][1] < 0.3
    # A burst of one is sent at once; so is a burst whose every member withdrew (it makes no call at all).
    outcomes, calls = _members(CallBatcher(5.0), [("c", 1, 7, 0.0), ("d", 2, None, 0.0), ("d", 2, None, 0.0)])
    assert outcomes == [14, "withdrawn", "withdrawn"] and [items for items, _ in calls] == [[7]]


def test_the_calls_error_reaches_every_member():
    outcomes, calls = _members(CallBatcher(5.0), [("b", 2, 1, 0.0), ("b", 2, 2, 0.0)], fail=ConnectionError("gone"))
    assert len(calls) == 1 and all(isinstance(o, ConnectionError) and str(o) == "gone" for o in outcomes)


def test_cancel_ends_the_waits_of_members_whose_burst_has_not_gone():
    async def run():
        batcher = CallBatcher(wait_s=5.0)
        waiting = asyncio.ensure_future(batcher.submit("b", 2, 1, Recorder(0.0)))
        await asyncio.sleep(0.01)
        batcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return batcher.pending()

    assert asyncio.run(run()) == 0


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickles with one argument, so it cannot be rebuilt
        super().__init__(f"{a}/{b}")


def test_each_group_gets_its_results_or_its_own_error():
    async def generate(request: int) -> int:
        if request == 13:
            raise ValueError("bad prompt")
        if request == 99:
            await asyncio.sleep(30)
        return -request

    groups = [[1, 2], [13, 3], [4, 99], [5]]
    start = time.monotonic()
    outcomes = asyncio.run(generate_groups(groups, generate, timeout_s=0.2))
    assert outcomes[0] == [-1, -2] and outcomes[3] == [-5]
    assert isinstance(outcomes[1], ValueError) and str(outcomes[1]) == "bad prompt"
    assert isinstance(outcomes[2], TimeoutError)  # its hung request was cancelled; the others came back
    assert time.monotonic() - start < 2
    converted = portable_error(Unpicklable(1, 2))
    assert type(converted) is RuntimeError and str(converted) == "Unpicklable: 1/2"


def _first_step_size(settle) -> int:
    """The engine actor's event loop in small: one burst call of 8 groups of 8 requests (`generate_groups`), each
    request added to vLLM after 0-3 awaits (AsyncLLM's own), and an idle engine core woken by the first add that
    runs `settle(count)` before its first step; how many requests that step starts with."""

    async def run() -> int:
        added, work = [0], asyncio.Event()

        async def generate(awaits: int) -> int:
            for _ in range(awaits):
                await asyncio.sleep(0)
            added[0] += 1
            work.set()
            return awaits

        async def core() -> int:
            await work.wait()
            await settle(lambda: added[0])
            return added[0]

        step = asyncio.create_task(core())
        await generate_groups([[g % 4] * 8 for g in range(8)], generate, 5.0)
        return await step

    return asyncio.run(run())


def test_an_idle_core_starts_with_every_request_of_the_burst():
    """A burst's requests reach vLLM a few loop iterations apart: a core that stepped after one yield started with
    part of them (the engine then ran the rest a step behind); waiting until the adds stop, it starts with all."""
    assert _first_step_size(lambda count: asyncio.sleep(0)) < 64
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
