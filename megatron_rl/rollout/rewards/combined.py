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
import dataclasses
import inspect
import time
from collections.abc import Callable
from typing import Any

from megatron_rl.rollout.rewards.calling import RewardFunction, outcome
from megatron_rl.rollout.rewards.math import basic_math_reward, math_reward, math_verify_reward
from megatron_rl.rollout.rewards.processes import ProcessWorkers
from megatron_rl.rollout.rewards.workers import DaemonWorkers, failure_text, guarded_call

ISOLATIONS = ("auto", "thread", "process")
"""Where plain reward functions run (`task.reward_isolation`)."""
PROCESS_REWARDS = (math_reward, math_verify_reward)
"""The reward functions "auto" runs in processes: math-verify's sympy can hold the GIL in C calls for minutes."""
SAMPLE_BLIND = (math_reward, math_verify_reward, basic_math_reward)
"""Built-in rewards that never read their `sample` argument: a process is sent None in its place (a sample may
hold megabytes of routes)."""


class RewardFailure(Exception):
    """One reward call failed; the message says how ("raised ValueError: ...", "timed out after ...")."""


async def _guarded_await(awaitable) -> tuple[bool, Any]:
    try:
        return True, await awaitable
    except (Exception, SystemExit) as err:  # CancelledError is not caught: cancelling the driver must work
        return False, failure_text(err)


START_WAIT_FACTOR = 10.0
"""A plain reward call that no worker has started after this many times its `timeout_s` fails (the workers are
stuck behind calls that never end, or cannot start a process)."""


class RewardRunner:
    """Runs reward calls within `timeout_s` each: plain functions on `workers` daemon threads or, as `isolation`
    says, in `workers` processes (`rollout/rewards/processes.py`), `async` ones on the loop. A call past its time is
    a failure; a thread cannot be stopped, so it is left to finish on its own and cannot keep the process from
    exiting; a process is killed and replaced.

    `isolation`: "thread", "process", or "auto": processes for the functions in `PROCESS_REWARDS` (math-verify's,
    however the config names them), threads for the rest."""

    def __init__(
        self, timeout_s: float, workers: int = 2, field: str = "task.reward_timeout_s", isolation: str = "auto"
    ):
        if isolation not in ISOLATIONS:
            raise ValueError(f"reward isolation {isolation!r}: expected one of {', '.join(ISOLATIONS)}")
        self.timeout_s, self.field, self.isolation = timeout_s, field, isolation
        self._threads = DaemonWorkers(workers)
        self._processes = ProcessWorkers(workers)  # no process starts before `start` or a first call

    @property
    def stuck_threads(self) -> int:
        """Plain reward calls written off past `timeout_s` (threads left to them, or processes killed)."""
        return self._threads.stuck_threads + self._processes.stuck_threads

    def in_process(self, spec: RewardFunction) -> bool:
        """Whether `spec`'s calls run in a reward process."""
        if spec.is_async or self.isolation == "thread":
            return False
        return self.isolation == "process" or spec.target() in PROCESS_REWARDS

    def start(self, functions: list[RewardFunction]) -> None:
        """Start the reward processes now if any of `functions` runs in one (each process loads them), so that
        no call's time goes to starting a process and importing its function."""
        isolated = [spec for spec in functions if self.in_process(spec)]
        if isolated:
            self._processes.start(isolated)

    async def call(self, spec: RewardFunction, args: tuple, kwargs: dict) -> Any:
        """The function's value; RewardFailure when it raises, exits or times out."""
        queued = None
        try:
            if spec.is_async:
                ok, value = await asyncio.wait_for(_guarded_await(spec.target()(*args, **kwargs)), self.timeout_s)
            else:
                isolated = self.in_process(spec)
                workers = self._processes if isolated else self._threads
                if isolated and spec.convention == "ours" and spec.target() in SAMPLE_BLIND:
                    args = (*args[:2], None)  # (response, answer, sample)
                future, queued = workers.submit(spec if isolated else spec.target(), args, kwargs)
                ok, value = await self._result(future, queued, workers)
                if ok and inspect.isawaitable(value):  # a plain function that returned a coroutine
                    queued = None
                    ok, value = await asyncio.wait_for(_guarded_await(value), self.timeout_s)
        except asyncio.CancelledError:
            if queued is not None:  # the driver is stopping: a call not yet started is not started
                workers.forget(queued)
            raise
        except asyncio.TimeoutError:
            if queued is not None:
                workers.abandon(queued)
            raise RewardFailure(f"timed out after {self.field}={self.timeout_s:g} s") from None
        except RewardFailure:
            raise
        except (Exception, SystemExit) as err:  # calling an async function may itself raise
            raise RewardFailure(failure_text(err)) from None
        if not ok:
            raise RewardFailure(value)
        return value

    async def _result(self, future: asyncio.Future, call, workers) -> tuple[bool, Any]:
        """The plain call's (ok, value), or TimeoutError `timeout_s` after it began to run: its wait in the queue
        for a free worker (or for its process to start) does not count, up to START_WAIT_FACTOR times `timeout_s`
        (each running call is bounded, so the queue moves; past that the call is dropped, a RewardFailure)."""
        queued_until = time.monotonic() + START_WAIT_FACTOR * self.timeout_s
        poll = min(self.timeout_s, max(0.5, self.timeout_s / 10))  # how late a call's start may be noticed
        wait = self.timeout_s
        while True:
            done, _ = await asyncio.wait((future,), timeout=wait)
            if done:
                return future.result()
            started, now = call.started_at, time.monotonic()
            if started is None and now >= queued_until:
                workers.forget(call)
                raise RewardFailure(
                    f"not started within {START_WAIT_FACTOR:g} x {self.field}={self.timeout_s:g} s: every reward"
                    " worker stayed busy, or none could start"
                )
            wait = poll if started is None else started + self.timeout_s - now
            if wait <= 0:
                raise asyncio.TimeoutError

    def shutdown(self) -> None:
        """Take no more calls (a later one raises RuntimeError); queued and running ones finish on their threads or
        processes (calls whose callers were cancelled are dropped before they start)."""
        self._threads.shutdown()
        self._processes.shutdown()


class InlineRunner:
    """Runs reward calls in the calling thread, without a time limit (scoring outside the driver)."""

    async def call(self, spec: RewardFunction, args: tuple, kwargs: dict) -> Any:
        """The function's value; RewardFailure when it raises or exits."""
        ok, value = guarded_call(spec.target(), args, kwargs)
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
