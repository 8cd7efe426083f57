"""Scoring a group: every reward function of the weighted sum on every response, the length penalties added,
each component kept per sample, and every way a reward can fail turned into a reason (never an escape).

A sample's reward is `sum(weight x value)` over the functions that returned a number for it (a TRL function may
return None: "does not apply", as TRL's nansum), plus the penalties (of its token count; responses scored
without a `Sample`, as in evaluation, get none). A function that raises (`sys.exit` included),
times out, or returns something other than a finite number or None fails the sample: its reward is NaN and the
reason names the function and the prompt's source (file and row).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from megatron_rl.rollout.rewards.calling import RewardFunction, outcome


class RewardFailure(Exception):
    """One reward call failed; the message says how ("raised ValueError: ...", "timed out after ...")."""


def _failure_text(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"raised {type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _guarded_call(fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, value) or (False, why): a reward's SystemExit must not end the thread it runs in, nor escape
    through the future to the event loop (asyncio re-raises SystemExit out of the loop)."""
    try:
        return True, fn(*args, **kwargs)
    except (Exception, SystemExit) as err:
        return False, _failure_text(err)


async def _guarded_await(awaitable) -> tuple[bool, Any]:
    try:
        return True, await awaitable
    except (Exception, SystemExit) as err:  # CancelledError is not caught: cancelling the driver must work
        return False, _failure_text(err)


class _Call:
    """One plain reward call queued for a worker thread, and how far it got (`DaemonWorkers` guards `state`)."""

    __slots__ = ("loop", "future", "fn", "args", "kwargs", "deadline", "state")

    def __init__(self, loop, future, fn, args, kwargs, deadline):
        self.loop, self.future, self.fn, self.args, self.kwargs = loop, future, fn, args, kwargs
        self.deadline = deadline  # time.monotonic() past which the call is not started
        self.state = "queued"  # -> "running" -> "done", or "abandoned" (past its time) at any point before "done"


def _settle(future: asyncio.Future, result) -> None:
    if not future.done():  # a call past its time was cancelled by `wait_for`
        future.set_result(result)


class DaemonWorkers:
    """`count` daemon threads that run plain reward calls off the event loop.

    Daemon because a call past its time cannot be stopped, and the interpreter joins the threads of a
    `ThreadPoolExecutor` at exit: one reward that never returned kept the launcher from exiting after its run. A
    call abandoned while it runs writes its thread off (the thread ends when the call returns) and a new thread
    takes its place; one still queued at its deadline is skipped."""

    def __init__(self, count: int):
        self.count = count
        self.stuck_threads = 0
        """Threads written off because their call ran past its time."""
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(count):
            self._start_thread()

    def _start_thread(self) -> None:
        threading.Thread(target=self._work, name="reward", daemon=True).start()

    def submit(self, fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> tuple[asyncio.Future, _Call]:
        """Queue `_guarded_call(fn, args, kwargs)`, to start within `timeout_s` or not at all; the future (of the
        running loop) gets its result."""
        if self._closed:
            raise RuntimeError("reward calls after the runner was shut down")
        loop = asyncio.get_running_loop()
        call = _Call(loop, loop.create_future(), fn, args, kwargs, time.monotonic() + timeout_s)
        self._calls.put(call)
        return call.future, call

    def abandon(self, call: _Call) -> None:
        """Give up on `call` (past its time): skipped if still queued, its thread replaced if running."""
        with self._lock:
            running = call.state == "running"
            if call.state != "done":
                call.state = "abandoned"
        if running:
            self.stuck_threads += 1
            self._start_thread()

    def forget(self, call: _Call) -> None:
        """Drop `call` if it has not started (its caller was cancelled); a running one finishes on its thread."""
        with self._lock:
            if call.state == "queued":
                call.state = "abandoned"

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            with self._lock:
                if call.state == "abandoned" or time.monotonic() >= call.deadline:
                    call.state = "abandoned"  # its caller has given up, or is about to
                    continue
                call.state = "running"
            result = _guarded_call(call.fn, call.args, call.kwargs)
            with self._lock:
                if call.state == "abandoned":
                    return  # written off: a new thread has this one's place
                call.state = "done"
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for this result
                call.loop.call_soon_threadsafe(_settle, call.future, result)

    def shutdown(self) -> None:
        """Take no more calls; the threads end once the calls queued before this ran (stuck ones end when their
        calls return)."""
        self._closed = True
        for _ in range(self.count):
            self._calls.put(None)


class RewardRunner:
    """Runs reward calls within `timeout_s` each: plain functions on `workers` daemon threads (off the event
    loop), `async` ones on the loop. A call past its time is a failure; its thread cannot be stopped, so it is
    left to finish on its own (`DaemonWorkers`) and cannot keep the process from exiting."""

    def __init__(self, timeout_s: float, workers: int = 2, field: str = "task.reward_timeout_s"):
        self.timeout_s, self.field = timeout_s, field
        self._threads = DaemonWorkers(workers)

    @property
    def stuck_threads(self) -> int:
        """Threads written off because a plain reward ran past `timeout_s`."""
        return self._threads.stuck_threads

    async def call(self, spec: RewardFunction, args: tuple, kwargs: dict) -> Any:
        """The function's value; RewardFailure when it raises, exits or times out."""
        queued = None
        try:
            if spec.is_async:
                ok, value = await asyncio.wait_for(_guarded_await(spec.target()(*args, **kwargs)), self.timeout_s)
            else:
                future, queued = self._threads.submit(spec.target(), args, kwargs, self.timeout_s)
                ok, value = await asyncio.wait_for(future, self.timeout_s)
                if ok and inspect.isawaitable(value):  # a plain function that returned a coroutine
                    queued = None
                    ok, value = await asyncio.wait_for(_guarded_await(value), self.timeout_s)
        except asyncio.CancelledError:
            if queued is not None:  # the driver is stopping: a call not yet started is not started
                self._threads.forget(queued)
            raise
        except asyncio.TimeoutError:
            if queued is not None:
                self._threads.abandon(queued)
            raise RewardFailure(f"timed out after {self.field}={self.timeout_s:g} s") from None
        except (Exception, SystemExit) as err:  # calling an async function may itself raise
            raise RewardFailure(_failure_text(err)) from None
        if not ok:
            raise RewardFailure(value)
        return value

    def shutdown(self) -> None:
        """Take no more calls (a later one raises RuntimeError); queued and running ones finish on their threads
        (calls whose callers were cancelled are dropped before they start)."""
        self._threads.shutdown()


class InlineRunner:
    """Runs reward calls in the calling thread, without a time limit (scoring outside the driver)."""

    async def call(self, spec: RewardFunction, args: tuple, kwargs: dict) -> Any:
        """The function's value; RewardFailure when it raises or exits."""
        ok, value = _guarded_call(spec.target(), args, kwargs)
        if ok and inspect.isawaitable(value):
            ok, value = await _guarded_await(value)
        if not ok:
            raise RewardFailure(value)
        return value


@dataclasses.dataclass
class Scored:
    """The reward of one sample and what it was made of."""

    reward: float
    """The weighted sum plus penalties; NaN when a function failed."""
    components: dict[str, float]
    """Each function's value (functions that returned None are left out) and each penalty."""
    info: dict[str, Any]
    """Extra entries of verl dict results, by function name."""
    error: str | None = None
    """Why the reward failed (names the function), else None."""


class RewardSet:
    """The reward functions of a task with their weights, and the length penalties (`shapers`)."""

    def __init__(self, functions: list[RewardFunction], shapers: list[Callable[[int], float]] | None = None):
        names = [f.name for f in functions]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward names must differ, {duplicates} repeat (set task.rewards[].name)")
        self.functions = functions
        self.shapers = list(shapers or [])

    @property
    def names(self) -> list[str]:
        """Component names: the functions', then the penalties'."""
        return [f.name for f in self.functions] + [s.name for s in self.shapers]

    async def score(self, responses: list[str], records: list[dict], samples: list[Any], runner) -> list[Scored]:
        """Score every response (of one prompt's group, or any list of them)."""
        n = len(responses)
        values: list[dict[str, float]] = [{} for _ in range(n)]
        info: list[dict[str, Any]] = [{} for _ in range(n)]
        errors: list[str | None] = [None] * n
        for spec in self.functions:
            results = await self._call(spec, responses, records, samples, runner)
            for i, (value, extras, error) in enumerate(results):
                if error is not None and errors[i] is None:
                    errors[i] = f"reward {spec.source!r} {error}"
                if value is not None:
                    values[i][spec.name] = value
                if extras:
                    info[i][spec.name] = extras
        weights = {f.name: f.weight for f in self.functions}
        scored = []
        for i in range(n):
            if errors[i] is None and not values[i]:
                errors[i] = "every reward function returned None" if len(self.functions) > 1 else (
                    f"reward {self.functions[0].source!r} returned None"
                )  # fmt: skip
            total = sum(weights[name] * v for name, v in values[i].items())
            components = dict(values[i])
            tokens = getattr(samples[i], "num_tokens", None)  # responses without a sample (evaluation): no penalty
            for shaper in self.shapers if tokens is not None else ():
                penalty = shaper(tokens)
                components[shaper.name] = penalty
                total += penalty
            if errors[i] is not None:
                where = records[i].get("source")
                errors[i] += f" (prompt {where})" if where else ""
                total = float("nan")
            scored.append(Scored(total, components, info[i], errors[i]))
        return scored

    async def _call(self, spec: RewardFunction, responses, records, samples, runner) -> list[tuple]:
        """(value, extras, error) per response for one function."""
        n = len(responses)
        calls = spec.arguments(responses, records, samples)
        results = await asyncio.gather(*(_attempt(runner, spec, args, kwargs) for args, kwargs in calls))
        if not spec.batched:
            return [outcome(value) if ok else (None, {}, value) for ok, value in results]
        ok, got = results[0]
        if not ok:
            return [(None, {}, got)] * n
        if hasattr(got, "tolist"):  # numpy arrays, tensors
            got = got.tolist()
        if not isinstance(got, (list, tuple)) or len(got) != n:
            what = f"{len(got)} values" if isinstance(got, (list, tuple)) else repr(got)[:80]
            return [(None, {}, f"returned {what} for {n} responses (one value per response expected)")] * n
        return [outcome(value) for value in got]


async def _attempt(runner, spec: RewardFunction, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(True, value) or (False, why) of one call."""
    try:
        return True, await runner.call(spec, args, kwargs)
    except RewardFailure as err:
        return False, str(err)
