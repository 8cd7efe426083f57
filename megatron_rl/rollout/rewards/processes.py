"""Reward calls in processes: a call past its time is killed with its process, which is replaced at once.

For rewards that can hold the GIL in one long C call (sympy under math-verify: for a response holding
`9^{9^{9}}` it raises an integer to a power of a billion bits, minutes in one C call), which on a thread of the
driver's process would stop its event loop and every timeout with it. Each process is fed over a pipe by a daemon
thread of the driver's process and dies with that thread (Linux's parent-death signal), so a busy one is not left
behind when the launcher is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
from collections.abc import Callable
from typing import Any

from megatron_rl.parallel.processes import die_with_parent
from megatron_rl.rollout.rewards.workers import _Call, _Workers, guarded_call

PROCESS_START_TIMEOUT_S = 120.0
"""Longest a reward process may take to start and import the package before its thread gives up on it."""
START_RETRY_S = 10.0
"""After a reward process failed to start, calls fail at once with its reason for this long before another start
is tried: the calls queued behind it do not each wait out a start of their own."""
KILL_WAIT_S = 5.0
"""How long to wait for a killed reward process to be reaped."""
EXIT_WAIT_S = 0.5
"""How long a process whose pipe closed on its own may take to exit, for its exit code, before it is killed."""
UNREADABLE = "cannot be read in a reward process"
"""How a reward process answers a message it cannot unpickle."""


def _key(spec) -> str:
    """What a process knows a reward function by: its name and what the config named."""
    return f"{spec.name}\0{spec.source}"


class _Child:
    """One reward process and the pipe to it; the functions it was sent, the call it runs (the workers' lock
    guards `current` and `doomed`)."""

    def __init__(self, context, preload: list):
        mine, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(theirs, os.getpid()), name="megatron-rl-reward", daemon=True)
        self.process.start()
        theirs.close()
        self.conn, self.known, self.doomed, self.current = mine, set(), False, None
        try:
            self._answer(PROCESS_START_TIMEOUT_S)  # its "ready" (EOFError: it died starting; its error is on stderr)
            for spec in preload:  # loaded (and warmed up) now, not in the time of its first call
                try:
                    data = pickle.dumps(("load", _key(spec), spec))
                except (Exception, SystemExit):  # noqa: S112 (one that does not travel is said at its calls)
                    continue
                self.conn.send_bytes(data)
                if pickle.loads(self._answer(PROCESS_START_TIMEOUT_S))[0]:
                    self.known.add(_key(spec))
        except BaseException:
            self.kill()
            raise

    def _answer(self, timeout_s: float | None = None) -> bytes:
        """The process's next message; EOFError when it ended, RuntimeError when `timeout_s` passed first. Waits
        on the process as well as the pipe: a child the reward left behind may hold the pipe open."""
        ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], timeout_s)
        if self.conn in ready:
            return self.conn.recv_bytes()
        if ready:
            raise EOFError("the reward process ended")
        raise RuntimeError(f"it did not answer within {timeout_s:g} s")

    def run(self, spec, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """Call reward `spec` (a `RewardFunction`) there; (ok, value or why)."""
        key = _key(spec)
        try:  # pickled whole before anything is written: what does not travel leaves the pipe intact
            data = pickle.dumps(("call", key, None if key in self.known else spec, args, kwargs))
        except (Exception, SystemExit) as err:  # pickling raises whatever the object's reduction raises
            return False, f"cannot be sent to a reward process ({type(err).__name__}: {err})"
        try:
            self.conn.send_bytes(data)
            self.known.add(key)
            reply = self._answer()
        except (EOFError, OSError):  # killed past its time (its caller gave up already), or crashed
            return False, self._died()
        try:
            ok, value = pickle.loads(reply)
        except (Exception, SystemExit) as err:  # as for pickling
            return False, f"its value cannot be read back ({type(err).__name__}: {err})"
        if not ok and str(value).startswith(UNREADABLE):
            self.known.discard(key)  # the function did not arrive: sent again with the next call
        return ok, value

    def _died(self) -> str:
        if not self.doomed:
            self.process.join(EXIT_WAIT_S)  # for the exit code of its own end
        code = self.process.exitcode
        self.kill()
        return f"its reward process died (exit code {code}; its error, if it printed one, is on the launcher's stderr)"

    def kill_group(self) -> None:
        """SIGKILL the process and whatever its reward started (its own process group), if not reaped yet: a
        reaped one's number may be another process's now."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.process.exitcode is None:
                os.killpg(self.process.pid, signal.SIGKILL)

    def kill(self) -> None:
        """End the process and its children now (a reward holding the GIL ignores everything but SIGKILL) and
        reap it."""
        self.kill_group()
        self.process.kill()
        self.process.join(KILL_WAIT_S)
        self.conn.close()

    def close(self) -> None:
        """Ask the process to end; killed if it does not within `EXIT_WAIT_S` (a call still running)."""
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(EXIT_WAIT_S)
        self.kill()

    @property
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.is_alive()


class ProcessWorkers(_Workers):
    """Reward calls in `count` processes (spawned, each fed by a daemon thread here). A call abandoned or
    forgotten while it runs is killed with its process, and the thread starts a new one at once, which loads the
    functions given to `start`. A function travels once per process (`RewardFunction` pickles a file's function
    by its file, which the process loads again)."""

    def __init__(self, count: int):
        super().__init__(count)
        self._context = multiprocessing.get_context("spawn")  # not fork: the driver's process has Ray's threads
        self._running: dict[int, _Child] = {}
        self._preload: list = []
        self._start_failed: tuple[float, str] | None = None  # (when, why) of the last failed start

    def start(self, specs: list) -> None:
        """Start the processes now, each loading the reward functions `specs` (their first calls then spend no time
        starting a process and importing)."""
        self._preload = list(specs)
        self.ensure_started()

    def abandon(self, call: _Call) -> None:
        """Give up on `call` (past its time): its process killed."""
        self._give_up(call, past_its_time=True)

    def forget(self, call: _Call) -> None:
        """Drop `call` (its caller was cancelled, or it never started): skipped if queued, its process killed if
        running."""
        self._give_up(call, past_its_time=False)

    def _give_up(self, call: _Call, past_its_time: bool) -> None:
        # Under one lock acquisition: the kill must land on the process while it still runs this very call.
        with self._lock:
            if call.state == "running":
                self.stuck_threads += past_its_time
                self._kill_running(call)
            if call.state != "done":
                call.state = "abandoned"

    def _kill_running(self, call: _Call) -> None:
        # Under the lock, and only while its process runs this call: never one that has moved on to the next.
        child = self._running.get(id(call))
        if child is not None and child.current is call:
            child.doomed = True
            child.kill_group()  # its thread sees it end, reaps it and starts another

    def _new_child(self) -> tuple[_Child | None, str]:
        """A started process, or (None, why); within START_RETRY_S of a failed start, (None, its why) at once."""
        failed = self._start_failed
        if failed is not None and time.monotonic() - failed[0] < START_RETRY_S:
            return None, failed[1]
        try:
            child = _Child(self._context, self._preload)
        except Exception as err:  # noqa: BLE001 (said in the calls' results; a later call tries again)
            self._start_failed = (time.monotonic(), f"no reward process: {type(err).__name__}: {err}")
            return None, self._start_failed[1]
        self._start_failed = None
        return child, ""

    def _work(self) -> None:
        child, _ = self._new_child()
        try:
            while (call := self._take()) is not None:
                if child is None or child.doomed or not child.alive:
                    if child is not None:
                        child.kill()
                    child, why = self._new_child()
                    if child is None:
                        self._deliver(call, (False, why))
                        continue
                with self._lock:
                    if call.state == "abandoned":  # given up on before its process was known
                        continue
                    child.current, self._running[id(call)] = call, child
                    call.started_at = time.monotonic()  # its time runs from here, not from a process's start
                try:
                    result = child.run(call.fn, call.args, call.kwargs)
                except (Exception, SystemExit) as err:  # this thread must live on: it is one of `count`
                    child.doomed = True
                    result = (False, f"its reward process failed: {type(err).__name__}: {err}")
                with self._lock:
                    child.current = None
                    self._running.pop(id(call), None)
                self._deliver(call, result)
                if child.doomed or not child.alive:  # replaced now, before the next call waits for it
                    child.kill()
                    child = None if self._closed else self._new_child()[0]
        finally:
            if child is not None:
                child.close()


def _load(spec) -> Callable | str:
    """The function of `spec`, its `warm_up` called if it has one (math-verify's imports), or why not."""
    ok, loaded = guarded_call(spec.target, (), {})
    if ok and callable(getattr(loaded, "warm_up", None)):
        guarded_call(loaded.warm_up, (), {})
    return loaded if ok else f"cannot be loaded in a reward process: {loaded}"


def _call(fn: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    ok, value = guarded_call(fn, args, kwargs)
    if ok and inspect.iscoroutine(value):  # a plain function that returned a coroutine
        ok, value = guarded_call(asyncio.run, (value,), {})
    return ok, value


def serve(conn, parent: int) -> None:
    """A reward process's loop: ("load", key, spec) loads a function; ("call", key, spec or None once sent,
    args, kwargs) calls it and answers (ok, value or why); None ends it."""
    die_with_parent(parent)
    os.setpgrp()  # a group of its own: a kill reaches what its reward started too
    multiprocessing.current_process().daemon = False  # a reward may start processes of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal group: the launcher decides
    logging.basicConfig(level=logging.ERROR, format="reward process %(process)d: %(levelname)s %(name)s: %(message)s")
    functions: dict[str, Callable | str] = {}  # by key: the function, or why it could not be loaded here
    conn.send_bytes(pickle.dumps("ready"))
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):  # the driver's process is gone
            return
        try:
            message = pickle.loads(raw)
        except (Exception, SystemExit) as err:  # a function or argument that cannot be rebuilt here
            conn.send_bytes(pickle.dumps((False, f"{UNREADABLE} ({type(err).__name__}: {err})")))
            continue
        if message is None:
            return
        kind, key, spec = message[:3]
        if spec is not None:
            functions[key] = _load(spec)
        if kind == "load":
            result = (True, None)  # loaded: the acknowledgement
        else:
            fn = functions.get(key, "was never sent to this reward process")
            result = (False, fn) if isinstance(fn, str) else _call(fn, *message[3:])
        try:
            data = pickle.dumps(result)
        except (Exception, SystemExit) as err:  # pickling raises whatever the value's reduction raises
            data = pickle.dumps((False, f"returned a value that cannot be sent back ({type(err).__name__}: {err})"))
        try:
            conn.send_bytes(data)
        except OSError:
            return
