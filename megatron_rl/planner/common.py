"""What every part of the planner shares: its error, the gigabyte it counts in, the bytes of each dtype."""

from __future__ import annotations

from megatron_rl.errors import UserError

GB = 10**9
"""Bytes in a (decimal) gigabyte, as GPU vendors count."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes of one parameter in each `model.dtype`."""


class PlanError(UserError, ValueError):
    """A run config that does not divide its model or cluster, or does not fit in GPU memory; names the field."""
