"""Where plain (not `async`) reward calls run, off the driver's event loop, each to be given up on at its time:
the queue and call bookkeeping they share, and `DaemonWorkers`, on threads. Cheap, but a call past its time cannot
be stopped (its thread is written off), and a reward that holds the GIL inside one C call stops every thread of the
process, the event loop included, until it returns: no timeout can fire meanwhile. `ProcessWorkers`
(`rollout/rewards/processes.py`) runs them in processes instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


def failure_text(err: BaseException) -> str:
    """How a reward call failed, in one line: "raised ValueError: its message"."""
    lines = str(err).strip().splitlines()
    return f"raised {type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def guarded_call(fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, value) or (False, why): a reward's SystemExit must not end the thread it runs in, nor escape
    through the future to the event loop (asyncio re-raises SystemExit out of the loop)."""
    try:
        return True, fn(*args, **kwargs)
    except (Exception, SystemExit) as err:
        return False, failure_text(err)


class _Call:
    """One plain reward call queued for a worker, and how far it got (the workers' lock guards `state`)."""

    __slots__ = ("loop", "future", "fn", "args", "kwargs", "started_at", "state")

    def __init__(self, loop, future, fn, args, kwargs):
        self.loop, self.future, self.fn, self.args, self.kwargs = loop, future, fn, args, kwargs
        self.started_at: float | None = None  # time.monotonic() when it began to run (set under the workers' lock)
        self.state = "queued"  # -> "running" -> "done", or "abandoned" (given up on) at any point before "done"


def _settle(future: asyncio.Future, result) -> None:
    if not future.done():  # a call past its time was cancelled by `wait_for`
        future.set_result(result)


class _Workers:
    """`count` daemon threads taking reward calls from one queue; subclasses say how a call runs."""

    def __init__(self, count: int):
        self.count = count
        self.stuck_threads = 0
        """Calls written off because they ran past their time (threads left to them, or processes killed)."""
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = 0

    def _start_thread(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name="reward", daemon=True).start()

    def submit(self, fn: Any, args: tuple, kwargs: dict) -> tuple[asyncio.Future, _Call]:
        """Queue a call of `fn` (a function for threads, a `RewardFunction` for processes); the future (of the
        running loop) gets its (ok, value or why), and the call's `started_at` says when it began to run."""
        if self._closed:
            raise RuntimeError("reward calls after the runner was shut down")
        self.ensure_started()
        loop = asyncio.get_running_loop()
        call = _Call(loop, loop.create_future(), fn, args, kwargs)
        self._calls.put(call)
        return call.future, call

    def ensure_started(self) -> None:
        """Start the threads if they are not running yet (on first use: a runner that never calls here costs
        nothing)."""
        with self._lock:
            if not self._threads:
                for _ in range(self.count):
                    self._start_thread()

    def _take(self, start_clock: bool = False) -> _Call | None:
        """The next call to run (marked running; with `start_clock`, its time starts now), or None once shut
        down."""
        while (call := self._calls.get()) is not None:
            with self._lock:
                if call.state == "abandoned":  # its caller was cancelled
                    continue
                call.state = "running"
                if start_clock:
                    call.started_at = time.monotonic()
            return call
        return None

    def _deliver(self, call: _Call, result: tuple[bool, Any]) -> bool:
        """Hand `result` to the call's future; False when the call was abandoned meanwhile."""
        with self._lock:
            if call.state == "abandoned":
                return False
            call.state = "done"
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for this result
            call.loop.call_soon_threadsafe(_settle, call.future, result)
        return True

    def _abandon(self, call: _Call) -> bool:
        """Mark `call` abandoned; whether it was running."""
        with self._lock:
            running = call.state == "running"
            if call.state != "done":
                call.state = "abandoned"
        return running

    def _work(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Take no more calls; the threads end once the calls queued before this ran."""
        self._closed = True
        for _ in range(self.count if self._threads else 0):  # written-off threads take no more calls
            self._calls.put(None)


class DaemonWorkers(_Workers):
    """Reward calls on daemon threads.

    Daemon because a call past its time cannot be stopped, and the interpreter joins the threads of a
    `ThreadPoolExecutor` at exit: one reward that never returned kept the launcher from exiting after its run. A
    call abandoned while it runs writes its thread off (the thread ends when the call returns) and a new thread
    takes its place."""

    def abandon(self, call: _Call) -> None:
        """Give up on `call` (past its time): its thread written off and replaced if it runs."""
        if self._abandon(call):
            self.stuck_threads += 1
            self._start_thread()

    def forget(self, call: _Call) -> None:
        """(On the call's loop) drop `call` (its caller was cancelled, or it never started): skipped if queued; if
        it runs, its thread is written off and replaced, so that a reward that never returns holds no worker. The
        new thread starts after the loop's ready callbacks: the calls cancelled with this one are dropped first."""
        if self._abandon(call):
            call.loop.call_soon(self._start_thread)

    def _work(self) -> None:
        while (call := self._take(start_clock=True)) is not None:
            if not self._deliver(call, guarded_call(call.fn, call.args, call.kwargs)):
                return  # written off: a new thread has this one's place
