"""Megatron's LR scheduler as megatron-rl builds it (a plain torch optimizer stands in for Megatron's: the
scheduler only sets `lr` in its parameter groups)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rl.config import OptimizerConfig  # noqa: E402
from megatron_rl.trainer.optimizer import build_scheduler  # noqa: E402


def _scheduler(steps: int):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    return optimizer, build_scheduler(optimizer, OptimizerConfig(lr=1e-3, lr_decay_style="cosine"), steps)


def _resumed(saved_steps: int, done: int, steps: int):
    """A scheduler of a `saved_steps` run after `done` updates, and one for `steps` resumed from its state."""
    _, first = _scheduler(saved_steps)
    for _ in range(done):
        first.step(1)
    optimizer, resumed = _scheduler(steps)
    resumed.load_state_dict(first.state_dict())
    return first, optimizer, resumed


def test_a_resumed_run_with_more_steps_follows_the_new_schedule():
    _, optimizer, extended = _resumed(saved_steps=10, done=10, steps=20)
    assert extended.num_steps == 10  # the step count does come from the checkpoint
    extended.step(1)
    # Cosine over 20 steps at step 11: about half the peak. Taken from the checkpoint, the schedule ended at step 10
    # and this was min_lr = 0.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        1e-3 * 0.5 * (1 + torch.cos(torch.tensor(11 / 20 * torch.pi)).item())
    )


def test_the_same_config_resumes_the_same_schedule():
    first, optimizer, resumed = _resumed(saved_steps=10, done=4, steps=10)
    first.step(1)
    resumed.step(1)
    assert optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]
