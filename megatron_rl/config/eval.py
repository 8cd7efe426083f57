"""The evaluation section: how often and how the validation prompts are evaluated during training."""

from __future__ import annotations

from pydantic import Field

from megatron_rl.config.base import Section


class EvalConfig(Section):
    """Evaluation on the validation prompts through the training engines (see rollout/evaluation.py)."""

    interval: int = Field(0, ge=0)
    """Evaluate every this many steps (once the trainer's version reaches each multiple) and after the last step;
    0: no evaluation."""
    n: int = Field(4, ge=1)
    """Sampled responses per prompt (at the rollout temperature) for `eval/pass@k` and `eval/mean@k`, k <= n;
    each prompt is also answered once greedily for `eval/reward_mean`."""
    pass_threshold: float = Field(1.0)
    """A sampled response passes (for pass@k) when its reward is at least this."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate at most this many validation prompts (the first ones; empty: all)."""
    max_concurrent_requests: int = Field(32, ge=1)
    """Evaluation requests in flight at once (beside generation's)."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest one evaluation may take; past it the evaluation is dropped with a warning (training goes on)."""
