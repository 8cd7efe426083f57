"""Where plain (not `async`) reward calls run, off the driver's event loop, each to be given up on at its time.

- `DaemonWorkers`: threads. Cheap, but a call past its time cannot be stopped (its thread is written off), and a
  reward that holds the GIL inside one C call stops every thread of the process, the event loop included, until
  it returns: no timeout can fire meanwhile.
- `ProcessWorkers`: processes. A call past its time is killed with its process, which is replaced. sympy under
  math-verify is such a case: a response holding `9^{9^{9}}` has it raise an integer to a power of a billion
  bits, minutes in one C call.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

PROCESS_START_TIMEOUT_S = 120.0
"""Longest a reward process may take to start and import the package before its thread gives up on it."""
KILL_WAIT_S = 5.0
"""How long to wait for a killed reward process to be reaped."""


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

    __slots__ = ("loop", "future", "fn", "args", "kwargs", "deadline", "state")

    def __init__(self, loop, future, fn, args, kwargs, deadline):
        self.loop, self.future, self.fn, self.args, self.kwargs = loop, future, fn, args, kwargs
        self.deadline = deadline  # time.monotonic() past which the call is not started
        self.state = "queued"  # -> "running" -> "done", or "abandoned" (past its time) at any point before "done"


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

    def submit(self, fn: Any, args: tuple, kwargs: dict, timeout_s: float) -> tuple[asyncio.Future, _Call]:
        """Queue a call of `fn` (what `_run` takes), to start within `timeout_s` or not at all; the future (of the
        running loop) gets its (ok, value or why)."""
        if self._closed:
            raise RuntimeError("reward calls after the runner was shut down")
        with self._lock:
            if not self._threads:  # started on first use: a runner that never calls here costs nothing
                for _ in range(self.count):
                    self._start_thread()
        loop = asyncio.get_running_loop()
        call = _Call(loop, loop.create_future(), fn, args, kwargs, time.monotonic() + timeout_s)
        self._calls.put(call)
        return call.future, call

    def forget(self, call: _Call) -> None:
        """Drop `call` if it has not started (its caller was cancelled); a running one finishes."""
        with self._lock:
            if call.state == "queued":
                call.state = "abandoned"

    def _take(self) -> _Call | None:
        """The next call to run (marked running), or None once shut down."""
        while (call := self._calls.get()) is not None:
            with self._lock:
                if call.state == "abandoned" or time.monotonic() >= call.deadline:
                    call.state = "abandoned"  # its caller has given up, or is about to
                    continue
                call.state = "running"
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
    takes its place; one still queued at its deadline is skipped."""

    def abandon(self, call: _Call) -> None:
        """Give up on `call` (past its time): skipped if still queued, its thread replaced if running."""
        if self._abandon(call):
            self.stuck_threads += 1
            self._start_thread()

    def _work(self) -> None:
        while (call := self._take()) is not None:
            if not self._deliver(call, guarded_call(call.fn, call.args, call.kwargs)):
                return  # written off: a new thread has this one's place


class _Child:
    """One reward process and the pipe to it; the functions it has been sent, by name."""

    def __init__(self, context):
        mine, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(theirs,), name="megatron-rl-reward", daemon=True)
        self.process.start()
        theirs.close()
        self.conn, self.known, self.doomed = mine, set(), False
        if not self.conn.poll(PROCESS_START_TIMEOUT_S):  # its "ready": the package imported
            self.kill()
            raise RuntimeError(f"a reward process did not start within {PROCESS_START_TIMEOUT_S:g} s")
        self.conn.recv()

    def run(self, spec, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """Call reward `spec` (a `RewardFunction`) there; (ok, value or why)."""
        first = spec.name not in self.known
        try:
            self.conn.send((spec.name, spec if first else None, args, kwargs))
        except (pickle.PicklingError, TypeError, AttributeError) as err:  # nothing was written: the pipe is intact
            return False, f"cannot be sent to a reward process ({type(err).__name__}: {err})"
        self.known.add(spec.name)
        try:
            return self.conn.recv()
        except (EOFError, OSError):  # killed (past its time: the caller gave up already) or crashed
            self.kill()
            return False, f"its reward process died (exit code {self.process.exitcode})"

    def kill(self) -> None:
        """End the process now (a reward holding the GIL ignores everything but SIGKILL)."""
        self.process.kill()
        self.process.join(KILL_WAIT_S)
        self.conn.close()

    @property
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.is_alive()


class ProcessWorkers(_Workers):
    """Reward calls in `count` processes (spawned, each with a daemon thread here that feeds it). A call abandoned
    while it runs is killed with its process; the thread starts a new one for its next call. The function travels
    once per process (`RewardFunction` pickles a file's function by its file, which the process loads again)."""

    def __init__(self, count: int):
        super().__init__(count)
        self._context = multiprocessing.get_context("spawn")  # not fork: the driver's process has Ray's threads
        self._running: dict[int, _Child] = {}

    def abandon(self, call: _Call) -> None:
        """Give up on `call` (past its time): skipped if still queued, its process killed if running."""
        if self._abandon(call):
            self.stuck_threads += 1
            child = self._running.get(id(call))
            if child is not None:  # its thread sees the pipe close (or `doomed`) and starts another for its next call
                child.doomed = True
                child.process.kill()

    def _work(self) -> None:
        child = None
        try:
            while (call := self._take()) is not None:
                try:
                    if child is not None and (child.doomed or not child.alive):
                        child.kill()  # reaped; a doomed one may have answered before its SIGKILL landed
                        child = None
                    if child is None:
                        child = _Child(self._context)
                except Exception as err:  # noqa: BLE001 (said in the call's result; the next call tries again)
                    child = None
                    self._deliver(call, (False, f"no reward process: {type(err).__name__}: {err}"))
                    continue
                self._running[id(call)] = child
                with self._lock:  # abandoned before `abandon` could see its process: not run at all
                    skip = call.state == "abandoned"
                if not skip:
                    self._deliver(call, child.run(call.fn, call.args, call.kwargs))
                self._running.pop(id(call), None)
        finally:
            if child is not None and child.alive:
                with contextlib.suppress(OSError):
                    child.conn.send(None)  # its loop ends; a daemon process dies with this one anyway
                child.conn.close()


def serve(conn) -> None:
    """A reward process's loop: (name, function spec or None once sent, args, kwargs) in, (ok, value) out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal group: the launcher decides
    functions: dict[str, Callable | str] = {}  # by name: the function, or why it could not be loaded here
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver's process is gone
            return
        if message is None:
            return
        name, spec, args, kwargs = message
        if spec is not None:
            ok, loaded = guarded_call(spec.target, (), {})
            functions[name] = loaded if ok else f"cannot be loaded in a reward process: {loaded}"
        fn = functions[name]
        result = (False, fn) if isinstance(fn, str) else guarded_call(fn, args, kwargs)
        try:
            conn.send(result)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            conn.send((False, f"returned a value that cannot be sent back ({type(err).__name__}: {err})"))
