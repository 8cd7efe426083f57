"""How far generation runs ahead of the trainer in `mode: async`: just in time, not as far as allowed.

The driver's gate lets the buffer account for the prompts of every step up to the trainer's, plus `prompts`
more (the lookahead). With the lookahead at its bound (`max_staleness` steps) an engine faster than the trainer
fills the buffer that far ahead and every batch trains at the largest staleness the config allows; one step
ahead is already enough to hide generation behind training when the engines keep up.

`Lookahead` sizes it from what the buffer sees of the trainer: for each batch handed out, how long the trainer
waited for it against the time since the previous one. Its idle fraction is read over the cycles since the
lookahead last changed (at most `window` of them), since the target is a share of the trainer's time, not a
bound on each wait: on a busy machine a batch is now and then a few milliseconds late whatever the lookahead, and
counted one by one such waits ratchet it up to the bound. An idle fraction above `target_idle` raises the
lookahead by one prompt per multiple of the target past the first, up to a quarter of a step (the trainer is
starved: generation must start earlier); `patience` cycles in a row under half the target lower it by one prompt
(the groups were ready early: they could have been generated later, on newer weights). Lowering slowly and raising fast keeps the waits rare
once the lookahead has found the edge: each probe below it costs one short wait. A probe costs the engines too: the
prompt it held back is generated apart from the rest of its step's prompts, in engine steps of its own. So a probe
that fails (the lookahead is raised again before the next lowering) doubles the calm cycles that a lowering back to
the level that failed waits for, up to `max_backoff` times `patience`; where such a level then holds for that long,
the back-off halves and the level is forgotten. The bound stays `max_prompts` (= `max_staleness` steps), the floor
0 (synchronous). Pure logic: no Ray, no clocks of its own.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Lookahead:
    """The lookahead in prompts, adjusted once per batch the trainer takes (module docstring)."""

    prompts_per_step: int
    """Prompts (groups) per trainer batch."""
    max_prompts: int
    """The hard bound: `max_staleness` steps' worth of prompts."""
    target_idle: float = 0.05
    """Largest share of its time the trainer may spend waiting for a batch."""
    prompts: int = -1
    """The current lookahead; -1 at construction means one step (or `max_prompts` if smaller)."""
    patience: int = 4
    """Cycles in a row without a wait before the lookahead is lowered by one prompt (times `backoff`)."""
    max_backoff: int = 16
    """Most times `patience` that a lowering waits for after failed probes."""
    backoff: int = 1
    """The current multiple of `patience` (module docstring)."""
    probing: bool = False
    """Whether the last change was a lowering that no raise has undone yet."""
    failed_at: int = -1
    """The level of the last failed probe (-1: none): lowering to it or below waits `backoff` times longer."""
    batches_seen: int = 0
    """Batches observed so far (the first one's wait is start-up, not generation falling behind)."""
    calm: int = 0
    """Cycles in a row without a wait so far."""
    window: int = 8
    """Most cycles the idle fraction is read over (those since the lookahead last changed)."""
    waited: list = dataclasses.field(default_factory=list)
    """(wait, cycle) seconds of the cycles since the lookahead last changed, the last `window` of them."""

    def __post_init__(self) -> None:
        if (
            self.prompts_per_step < 1
            or self.max_prompts < 0
            or not 0 < self.target_idle < 1
            or self.patience < 1
            or self.window < 1
            or self.max_backoff < 1
        ):
            raise ValueError(
                f"Lookahead: prompts_per_step={self.prompts_per_step} must be >= 1, max_prompts={self.max_prompts}"
                f" >= 0, target_idle={self.target_idle} in (0, 1), patience={self.patience}, window={self.window}"
                f" and max_backoff={self.max_backoff} >= 1"
            )
        if self.prompts < 0:
            self.prompts = min(self.prompts_per_step, self.max_prompts)

    @property
    def steps(self) -> float:
        """The lookahead in trainer steps."""
        return self.prompts / self.prompts_per_step

    def observe(self, wait_s: float, cycle_s: float | None) -> int:
        """One batch was handed out after the trainer waited `wait_s` in a cycle of `cycle_s` seconds since the
        previous batch (None for the first); returns the new lookahead."""
        self.batches_seen += 1
        if cycle_s is None or cycle_s <= 0 or self.batches_seen == 1:
            return self.prompts
        self.waited = [*self.waited, (max(0.0, wait_s), cycle_s)][-self.window :]
        idle = min(1.0, sum(w for w, _ in self.waited) / sum(c for _, c in self.waited))
        if idle > self.target_idle:
            # Up to a quarter step for a long wait; one prompt for a wait just past the target (on a busy
            # machine such waits come and go whatever the lookahead, and a quarter step each ratchets it up).
            raise_by = min(math.ceil(self.prompts_per_step / 4), max(1, math.ceil(idle / self.target_idle) - 1))
            if self.probing:  # the last lowering went below the edge
                self.backoff, self.failed_at = min(self.max_backoff, 2 * self.backoff), self.prompts
            self.prompts = min(self.max_prompts, self.prompts + raise_by)
            self.calm, self.waited, self.probing = 0, [], False
        elif idle < self.target_idle / 2:
            self.calm += 1
            self._lower_when_due()
        else:
            self.calm = 0
        return self.prompts

    def _lower_when_due(self) -> None:
        """Lower the lookahead by one prompt once enough calm cycles passed: `patience`, times `backoff` where that
        goes back to the level of a failed probe or below; a failed level that held that long is forgotten."""
        waits = self.patience * (self.backoff if self.prompts - 1 <= self.failed_at else 1)
        if self.prompts == 0 or self.calm < waits:
            return
        if self.probing and self.prompts <= self.failed_at:  # it held that long at a level that once failed
            self.backoff, self.failed_at = max(1, self.backoff // 2), -1
        self.prompts, self.calm, self.waited, self.probing = self.prompts - 1, 0, [], True
