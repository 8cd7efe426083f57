"""A driver claim's bursts: the groups one claim dealt to one engine travel as one engine call and one buffer call.

One driver claim deals a step's prompts out to the engines' workers, each worker serving one prompt's group. Were
each to make its own actor calls, an engine would get its groups a few milliseconds apart, and an idle vLLM
starts a step with the first request it gets: the others would join in later steps, each stage of the batch then
running on a part of it, with more (and emptier) steps for the same tokens. And every Ray actor call costs CPU
in the caller, the callee and Ray's own processes (`bench/ray_calls.py`; docs/benchmarks.md, "One call per
burst"), which a small machine takes from generation and training.

So the workers of a burst hand their calls to a `CallBatcher`: it waits until every member has come (at most
`wait_s` after the first), makes one call for all of them and gives each member its own share of the answer.

The engine then gets all of a burst's requests in one call, but its coroutines still add them to vLLM a few
event-loop iterations apart: an engine core stepped in the actor's own event loop (`rollout/vllm_inproc.py`)
would start with the first ones alone. `until_quiet` is how it waits for the rest first.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import pickle
from collections.abc import Awaitable, Callable, Hashable

CLOSED_KEPT = 256
"""How many flushed bursts are remembered, so that a member arriving after its burst went is sent at once."""
QUIET_ROUNDS = 2
"""Event-loop iterations in a row that add no request before `until_quiet` returns."""
MAX_ROUNDS = 16
"""Most iterations `until_quiet` yields for, whatever arrives."""

Call = Callable[[list], Awaitable[list]]
"""One call for a burst's items, answering one outcome per item, in order."""


async def until_quiet(count: Callable[[], int], quiet: int = QUIET_ROUNDS, limit: int = MAX_ROUNDS) -> int:
    """Yield to the event loop until `quiet` iterations in a row leave `count()` (requests added so far) unchanged,
    or `limit` iterations passed; returns the iterations taken. Costs microseconds when nothing else is ready."""
    still, rounds, seen = 0, 0, count()
    while still < quiet and rounds < limit:
        await asyncio.sleep(0)
        rounds += 1
        now = count()
        still, seen = (still + 1 if now == seen else 0), now
    return rounds


def portable_error(err: Exception) -> Exception:
    """`err` as one item's outcome in a burst call's answer: itself where it pickles back as itself (Ray sends the
    answer pickled), else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


async def generate_groups(groups: list[list], generate: Callable[[object], Awaitable], timeout_s: float) -> list:
    """`generate(request)` for every request of a burst's groups, all at once: per group the list of its results
    within `timeout_s`, or the error that failed it (`TimeoutError` when late: its requests are cancelled), as
    `portable_error` makes it. One group's failure is not the others'."""

    async def one(requests: list) -> list:
        return list(await asyncio.wait_for(asyncio.gather(*(generate(r) for r in requests)), timeout_s))

    outcomes = await asyncio.gather(*(one(requests) for requests in groups), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # a cancel of the call itself, not a failed group
    return [portable_error(o) if isinstance(o, Exception) else o for o in outcomes]


@dataclasses.dataclass
class _Burst:
    size: int
    call: Call | None  # None while only withdrawn members have come
    timer: asyncio.TimerHandle
    come: int = 0
    items: list = dataclasses.field(default_factory=list)
    futures: list = dataclasses.field(default_factory=list)


class CallBatcher:
    """The members of each burst (asyncio, one event loop) calling as one; see the module docstring."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        """The longest a burst waits for its missing members, from its first member's arrival."""
        self._open: dict[Hashable, _Burst] = {}
        self._closed: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._running: set[asyncio.Task] = set()

    def pending(self) -> int:
        """Bursts still waiting for members."""
        return len(self._open)

    async def submit(self, key: Hashable, size: int, item, call: Call):
        """Member `item` of burst `key` (of `size` members): its outcome of `call(items)`, made once every member has
        come or withdrawn, or `wait_s` after the first came (a late member is then sent alone). The call of the
        burst's first member is the one made; an error it raises is raised in every member."""
        if size <= 1 or key in self._closed:
            return (await call([item]))[0]
        burst = self._burst(key, size)
        burst.call = burst.call or call
        future = asyncio.get_running_loop().create_future()
        burst.items.append(item)
        burst.futures.append(future)
        self._arrive(key, burst)
        return await future

    def withdraw(self, key: Hashable, size: int) -> None:
        """A member of burst `key` that has nothing to send (its group failed): the burst goes without it."""
        if size <= 1 or key in self._closed:
            return
        self._arrive(key, self._burst(key, size))

    def cancel(self) -> None:
        """Drop waiting bursts and cancel the calls under way (the driver stops): their members' waits end."""
        for key in list(self._open):
            burst = self._open.pop(key)
            burst.timer.cancel()
            for future in burst.futures:
                future.cancel()
        for task in list(self._running):
            task.cancel()

    def _burst(self, key: Hashable, size: int) -> _Burst:
        """Burst `key`, opened (its wait started) by its first member to come, with or without an item."""
        burst = self._open.get(key)
        if burst is None:
            timer = asyncio.get_running_loop().call_later(self.wait_s, self._flush, key)
            burst = self._open[key] = _Burst(size, None, timer)
        return burst

    def _arrive(self, key: Hashable, burst: _Burst) -> None:
        burst.come += 1
        if burst.come >= burst.size:
            self._flush(key)

    def _flush(self, key: Hashable) -> None:
        burst = self._open.pop(key, None)
        self._closed[key] = None
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)
        if burst is None:
            return
        burst.timer.cancel()
        if burst.items:
            task = asyncio.ensure_future(self._send(burst))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _send(self, burst: _Burst) -> None:
        try:
            outcomes = await burst.call(burst.items)
            if len(outcomes) != len(burst.items):
                raise RuntimeError(f"a burst call answered {len(outcomes)} outcomes for {len(burst.items)} items")
        except asyncio.CancelledError:
            for future in burst.futures:
                future.cancel()
            raise
        except Exception as err:  # every member gets the call's error: each deals with its own item
            for future in burst.futures:
                if not future.done():
                    future.set_exception(err)
            return
        for future, outcome in zip(burst.futures, outcomes):
            if not future.done():  # a member cancelled meanwhile (the driver stops)
                future.set_result(outcome)
