"""The engine side of a driver claim: hold the group calls of one claim until all of them have arrived, so that
their requests reach vLLM together.

One driver claim deals a step's prompts out to the engines' workers, and each worker makes its own actor call.
The calls reach an engine a few milliseconds apart, and an idle vLLM starts a step with the first request it
gets: the others join in later steps, each stage of the batch then runs on a part of it, and the engine takes
more (and emptier) steps for the same tokens. A burst is the calls one claim dealt to one engine; its calls wait
here for each other, at most `wait_s`, and then go on together.

Going on together takes the released calls a few event-loop iterations each (the wake-ups of their waits), while
the call that completed the burst goes on at once: an engine core stepped in the actor's own event loop
(`rollout/vllm_inproc.py`) would start with that call's requests alone. `until_quiet` is how it waits for the
rest first.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

CLOSED_KEPT = 256
"""How many released bursts are remembered, so that a call arriving after its burst was let go passes at once."""


QUIET_ROUNDS = 2
"""Event-loop iterations in a row that add no request before `until_quiet` returns."""
MAX_ROUNDS = 16
"""Most iterations `until_quiet` yields for, whatever arrives."""


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


class BurstGate:
    """Per engine: the bursts whose calls are still arriving (asyncio; one event loop)."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        """The longest a call waits for the rest of its burst (from its own arrival)."""
        self._open: dict[int, list] = {}  # burst id -> [calls arrived, asyncio.Event set on release]
        self._closed: collections.OrderedDict[int, None] = collections.OrderedDict()

    def pending(self) -> int:
        """Bursts with calls waiting for the rest of theirs."""
        return len(self._open)

    async def arrive(self, burst: int, size: int) -> None:
        """Return once all `size` calls of `burst` have arrived, or `wait_s` after this one did (the burst is then
        let go: a lost or late call does not hold the others twice)."""
        if burst in self._closed or size <= 1:
            return
        entry = self._open.setdefault(burst, [0, asyncio.Event()])
        entry[0] += 1
        if entry[0] >= size:
            self._release(burst)
            return
        try:
            await asyncio.wait_for(entry[1].wait(), self.wait_s)
        except asyncio.TimeoutError:
            self._release(burst)

    def _release(self, burst: int) -> None:
        entry = self._open.pop(burst, None)
        if entry is not None:
            entry[1].set()
        self._closed[burst] = None
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)
