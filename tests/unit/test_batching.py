"""Groups from the buffer -> the trainer's batch: token layout, mask alignment, behaviour logprobs, advantages."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.batching import groups_to_batch, pad_length, rollout_stats
from megatron_rl.rollout.types import Group, Sample


def _sample(index, prompt, response, reward, version=0):
    logprobs = [-0.1 * (i + 1) for i in range(len(response))]
    return Sample(
        prompt, response, logprobs, [version] * len(response), reward=reward, prompt_index=index, group_id=str(index)
    )


def _groups():
    g0 = Group(0, [_sample(0, [5, 6, 7], [8, 9], 1.0), _sample(0, [5, 6, 7], [10], 0.0)])
    g1 = Group(1, [_sample(1, [11, 12], [13, 14, 15], 0.5, version=2), _sample(1, [11, 12], [16], 0.5, version=1)])
    return [g0, g1]


def test_tokens_mask_and_behaviour_logprobs_line_up():
    batch = groups_to_batch(_groups(), "grpo", tp=4)
    assert batch.tokens.shape == (4, 8)  # longest is 5 tokens, padded to a multiple of tp=4
    assert batch.tokens[0, :5].tolist() == [5, 6, 7, 8, 9]
    # Position t predicts token t+1: the first response token (index 3) is predicted at position 2.
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert batch.loss_mask[2].tolist() == [0, 1, 1, 1, 0, 0, 0]
    assert batch.behaviour_logprobs[0, 2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert batch.behaviour_logprobs[0][batch.loss_mask[0] == 0].abs().sum() == 0
    batch.validate(tp=4)


def test_group_relative_advantages():
    batch = groups_to_batch(_groups(), "grpo", tp=1)
    # Group 0: rewards 1 and 0 -> +/- 1/std (sample std of [1, 0] is 0.7071); group 1: equal rewards -> 0.
    assert batch.advantages[:2].tolist() == pytest.approx([0.7071, -0.7071], abs=1e-3)
    assert batch.advantages[2:].tolist() == [0.0, 0.0]
    rloo = groups_to_batch(_groups(), "rloo", tp=1)
    assert rloo.advantages[:2].tolist() == pytest.approx([1.0, -1.0])


def test_rollout_stats_staleness_is_the_oldest_token():
    stats = rollout_stats(_groups(), trainer_version=3)
    assert stats["staleness/histogram"] == {"2": 1, "3": 1}
    assert stats["reward/mean"] == pytest.approx(0.5)
    assert stats["rollout/tokens"] == 7


def test_pad_length():
    assert [pad_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert torch.equal(groups_to_batch(_groups(), "grpo", tp=1).tokens[:, 5:], torch.zeros(4, 1, dtype=torch.long))
