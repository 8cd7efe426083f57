"""Reward functions for tests/unit/test_reward_processes.py, in a module of their own: a reward process imports
the module of each function it is sent, and this one imports nothing heavy."""

from __future__ import annotations


def exact(response, answer, sample=None):
    """1.0 when the response is the answer."""
    return float(response == str(answer))


def holds_the_gil(response, answer, sample=None):
    """Minutes in one C call that never lets another thread of its process run (as sympy's big powers do)."""
    return float(sum(range(10**12)) > 0)


def returns_a_lambda(response, answer, sample=None):
    """A value that cannot be pickled back."""
    return {"score": 1.0, "how": lambda: None}


async def async_exact(response, answer, sample=None):
    """An async reward: it stays on the event loop."""
    return exact(response, answer)


def _refuse_to_load():
    raise ValueError("not here")


class RefusesToLoad:
    """Pickles in the reward process, but raises where it is read back."""

    def __reduce__(self):
        return _refuse_to_load, ()


class RefusesToPickle:
    """Raises ValueError (not a pickling error) when pickled."""

    def __reduce__(self):
        raise ValueError("no pickling this")


def returns_refuses_to_load(response, answer, sample=None):
    """A value whose unpickling raises in the driver's process."""
    return RefusesToLoad()


def returns_a_coroutine(response, answer, sample=None):
    """A plain function whose value is a coroutine (as a sync wrapper of an async judge may return)."""
    return async_exact(response, answer)


def sleeps_then_exact(response, answer, sample=None):
    """`exact` after 0.4 s (calls that queue behind each other on one worker)."""
    import time

    time.sleep(0.4)
    return float(response == str(answer))


def half(response, answer, sample=None):
    """0.5 for any response (a second function to give the same reward name)."""
    return 0.5


def leaves_a_child(response, answer, sample=None):
    """Starts a child that inherits the pipe to the driver and outlives this call, then runs past any timeout."""
    import subprocess
    import time

    subprocess.Popen(["sleep", "31.5"], close_fds=False)
    time.sleep(600)
    return 1.0


def uses_a_process(response, answer, sample=None):
    """Starts a process of its own (as code-execution rewards do)."""
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=abs, args=(0,))
    process.start()
    process.join(60)
    return float(process.exitcode == 0)


def math_verify_imported(response, answer, sample=None):
    """1.0 where math-verify has been imported in this process."""
    import sys

    return float("math_verify" in sys.modules)


def _exit_on_load():
    raise SystemExit("bye")


class ExitsOnLoad:
    """Raises SystemExit where it is read back."""

    def __reduce__(self):
        return _exit_on_load, ()


def returns_exits_on_load(response, answer, sample=None):
    """A value whose unpickling calls sys.exit in the driver's process."""
    return ExitsOnLoad()
