"""The one base class of errors whose message tells the user everything: what failed and where (file, row,
field, engine, rank). The `megatron-rl` command prints such an error as one line and exits 2, with no traceback;
anything else is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(Exception):
    """Base of the errors the command line reports in one line (mixed in beside ValueError, RuntimeError, ...)."""


def error_line(err: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message` (at most `limit` characters of it): enough to say why, fit for a log.

    An error raised inside a Ray task or actor call speaks through its cause (Ray's `RayTaskError.cause`): Ray's
    own first line names only the call and the process ("ray::VLLMEngine.start() (pid=..., ...)")."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    lines = str(err).strip().splitlines()
    first = lines[0][:limit] if lines else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
