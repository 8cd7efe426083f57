"""Length shaping added to any reward: DAPO's soft overlong punishment and a linear length penalty.

Both depend only on the number of response tokens, and both are kept per sample as their own component
(`overlong_penalty`, `length_penalty`) beside the rewards they are added to.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    """DAPO (Yu et al., 2025): 0 up to `max_tokens - buffer_tokens` tokens, then falling linearly to `-factor` at
    `max_tokens`, and `-factor` beyond (as verl's DAPO reward manager computes it)."""

    buffer_tokens: int
    """Length of the ramp."""
    max_tokens: int
    """Where the penalty reaches `-factor` (the longest response the engines generate)."""
    factor: float = 1.0
    """The penalty at `max_tokens`."""
    name: str = "overlong_penalty"
    """Its component name."""

    def __post_init__(self) -> None:
        if not 0 < self.buffer_tokens <= self.max_tokens:
            raise ValueError(
                f"overlong penalty: buffer_tokens={self.buffer_tokens} must be in 1..max_tokens={self.max_tokens}"
            )

    def __call__(self, num_tokens: int) -> float:
        """The (non-positive) amount added to the reward of a response of `num_tokens` tokens."""
        exceed = num_tokens - (self.max_tokens - self.buffer_tokens)
        return max(-self.factor, min(0.0, -exceed / self.buffer_tokens * self.factor))


@dataclasses.dataclass(frozen=True)
class LengthPenalty:
    """`-coef x max(0, tokens - free_tokens) / (max_tokens - free_tokens)`: a cost per token past a free length,
    `-coef` at `max_tokens`."""

    coef: float
    """The penalty at `max_tokens`."""
    max_tokens: int
    """Where the penalty reaches `-coef`."""
    free_tokens: int = 0
    """Tokens that cost nothing."""
    name: str = "length_penalty"
    """Its component name."""

    def __post_init__(self) -> None:
        if not 0 <= self.free_tokens < self.max_tokens:
            raise ValueError(
                f"length penalty: free_tokens={self.free_tokens} must be below max_tokens={self.max_tokens}"
            )

    def __call__(self, num_tokens: int) -> float:
        """The (non-positive) amount added to the reward of a response of `num_tokens` tokens."""
        return -self.coef * max(0, num_tokens - self.free_tokens) / (self.max_tokens - self.free_tokens)
