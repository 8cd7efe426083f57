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


def half(response, answer, sample=None):
    """0.5 for any response (a second function to give the same reward name)."""
    return 0.5
