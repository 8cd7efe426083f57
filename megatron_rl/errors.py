"""The one base class of errors whose message tells the user everything: what failed and where (file, row,
field, engine, rank). The `megatron-rl` command prints such an error as one line and exits 2, with no traceback;
anything else is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(Exception):
    """Base of the errors the command line reports in one line (mixed in beside ValueError, RuntimeError, ...)."""
