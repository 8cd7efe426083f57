"""Groups from the buffer -> the trainer's batch: token layout, mask alignment, behaviour logprobs, advantages."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.metrics.step import rollout_stats
from megatron_rl.rollout.types import Group, Sample
from megatron_rl.trainer.batch import groups_to_batch, pad_length


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


def test_ragged_samples_land_where_a_per_sample_layout_puts_them():
    """The batch's one-scatter layout against the obvious per-sample loop, on random prompt and response lengths
    (an empty response among them) with versions and teacher logprobs."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for index in range(5):
        samples = []
        for _ in range(3):
            prompt = torch.randint(3, 500, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
            n = int(torch.randint(0, 7, (1,), generator=gen))
            response = torch.randint(3, 500, (n,), generator=gen).tolist()
            versions = torch.randint(0, 4, (n,), generator=gen).tolist()
            sample = Sample(prompt, response, torch.randn(n, generator=gen).tolist(), versions, reward=1.0,
                            prompt_index=index, group_id=str(index), teacher_logprobs=torch.randn(n, generator=gen).tolist())  # fmt: skip
            samples.append(sample)
        groups.append(Group(index, samples))
    batch = groups_to_batch(groups, "grpo", tp=2)
    tokens, mask = torch.zeros_like(batch.tokens), torch.zeros_like(batch.loss_mask)
    behaviour, teacher = torch.zeros_like(batch.behaviour_logprobs), torch.zeros_like(batch.teacher_logprobs)
    versions = torch.full_like(batch.versions, -1)
    for row, sample in enumerate(s for g in groups for s in g.samples):
        ids = sample.prompt_ids + sample.response_ids
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        start, end = len(sample.prompt_ids) - 1, len(sample.prompt_ids) - 1 + len(sample.response_ids)
        mask[row, start:end] = 1.0
        behaviour[row, start:end] = torch.tensor(sample.logprobs)
        teacher[row, start:end] = torch.tensor(sample.teacher_logprobs)
        versions[row, start:end] = torch.tensor(sample.versions, dtype=torch.long)
    assert any(len(s.response_ids) == 0 for g in groups for s in g.samples)
    for got, want in [(batch.tokens, tokens), (batch.loss_mask, mask), (batch.behaviour_logprobs, behaviour),
                      (batch.teacher_logprobs, teacher), (batch.versions, versions)]:  # fmt: skip
        assert torch.equal(got, want)


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


def test_rollout_stats_truncated_share_and_reward_components():
    groups = _groups()
    samples = [s for g in groups for s in g.samples]
    for sample, reason in zip(samples, ["stop", "length", "stop", "length"], strict=True):
        sample.finish_reason = reason
    samples[0].metadata["rewards"] = {"accuracy": 1.0, "overlong": -0.5, "mean": 2.0}
    samples[1].metadata["rewards"] = {"accuracy": 0.0, "overlong": 0.0}
    stats = rollout_stats(groups, trainer_version=3)
    assert stats["response/truncated_frac"] == 0.5
    assert stats["reward/accuracy"] == 0.5 and stats["reward/overlong"] == -0.25  # over the samples that have it
    assert stats["reward/mean_component"] == 2.0 and stats["reward/mean"] == pytest.approx(0.5)  # not overwritten


def test_pad_length():
    assert [pad_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert torch.equal(groups_to_batch(_groups(), "grpo", tp=1).tokens[:, 5:], torch.zeros(4, 1, dtype=torch.long))


def test_padding_mask_from_lengths_and_from_the_loss_mask():
    from megatron_rl.trainer.batch import TrainBatch

    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    batch = TrainBatch(
        tokens=torch.arange(12).view(2, 6), loss_mask=mask, advantages=torch.zeros(2), behaviour_logprobs=mask * 0
    )
    # Without lengths: row 0 ends at its last response token (position 4); row 1 has no known end.
    assert batch.padding_mask().tolist() == [[False] * 5 + [True], [False] * 6]
    with_lengths = batch.replace(lengths=torch.tensor([5, 3]))
    assert with_lengths.padding_mask().tolist() == [[False] * 5 + [True], [False] * 3 + [True] * 3]
    with pytest.raises(ValueError, match="lengths"):
        batch.replace(lengths=torch.tensor([7, 3])).validate()
    with pytest.raises(ValueError, match="lengths: row 0 has loss_mask beyond its length 4"):
        batch.replace(lengths=torch.tensor([4, 3])).validate()  # row 0 predicts token 4, the fifth
    with_lengths.validate()


def test_stage_padding_mask_is_the_tp_ranks_sequence_slice_after_the_first_stage():
    from types import SimpleNamespace

    from megatron_rl.trainer.logprobs import stage_padding_mask

    padding = torch.arange(8).view(1, 8) >= 5
    layout = SimpleNamespace(tp=2)
    first = SimpleNamespace(is_first_stage=True, layout=layout, tp_rank=1)
    later = SimpleNamespace(is_first_stage=False, layout=layout, tp_rank=1)
    assert stage_padding_mask(padding, first, sequence_parallel=True) is padding  # Megatron scatters it there
    assert stage_padding_mask(padding, later, sequence_parallel=True).tolist() == [[False, True, True, True]]
    assert stage_padding_mask(padding, later, sequence_parallel=False) is padding


def test_batches_carry_each_sequence_length():
    groups = _groups()
    batch = groups_to_batch(groups, "grpo", tp=4)
    want = [len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples]
    assert batch.lengths.tolist() == want
    assert batch.padding_mask().sum(dim=1).tolist() == [batch.seq_len - n for n in want]


def test_rewards_reach_the_advantages_in_float64():
    """A reward of 1e39 was inf in float32 (NaN advantages), and rewards near 1e20 lost their spread (all 0)."""
    groups = _groups()
    for sample, reward in zip(groups[0].samples, (1e20, 1e20 + 2**20)):
        sample.reward = reward
    for sample, reward in zip(groups[1].samples, (1e39, -1e39)):
        sample.reward = reward
    batch = groups_to_batch(groups, "grpo", tp=1)
    assert batch.rewards.dtype == torch.float64 and batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.advantages.tolist() == pytest.approx([-0.7071, 0.7071, 0.7071, -0.7071], abs=1e-3)
    batch.validate()


def test_minibatches_are_equal_consecutive_slices():
    batch = groups_to_batch(_groups(), "grpo", tp=1)
    parts = batch.minibatches(2)
    assert [p.batch_size for p in parts] == [2, 2]
    assert torch.equal(torch.cat([p.tokens for p in parts]), batch.tokens)
    with pytest.raises(ValueError, match="cannot be split into algorithm.ppo_minibatches=3"):
        batch.minibatches(3)


def test_kept_sets_line_up_with_the_response_positions():
    """`TrainBatch.kept_tokens` [B, S-1, K]: the engine's sets at the positions that predict response tokens
    (padded to the widest), KEEP_ALL elsewhere, unknown rows for a sample that carries none."""
    import numpy as np

    from megatron_rl.algorithms.sampling_mask import KEEP_ALL
    from megatron_rl.models.routes import encode_kept_sets

    groups = _groups()
    groups[0].samples[0].metadata["kept_sets"] = encode_kept_sets(np.array([[8, 4], [9, -1]], dtype=np.int32))
    groups[1].samples[0].metadata["kept_sets"] = encode_kept_sets(np.array([[13], [14], [15]], dtype=np.int32))
    batch = groups_to_batch(groups, "grpo", tp=4)
    kept = batch.kept_tokens
    assert kept.shape == (4, 7, 2) and kept.dtype == torch.int32
    assert kept[0, 2:4].tolist() == [[8, 4], [9, -1]]
    assert kept[0, [0, 1, 4, 5, 6], 0].tolist() == [KEEP_ALL] * 5
    assert kept[1, 2].tolist() == [-1, -1]  # sample without sets: unknown, recomputed by the trainer
    assert kept[2, 1:4].tolist() == [[13, -1], [14, -1], [15, -1]]
    batch.validate(tp=4)
    assert batch.select(slice(0, 2)).kept_tokens.shape == (2, 7, 2)
    assert groups_to_batch(_groups(), "grpo", tp=4).kept_tokens is None
    groups[0].samples[0].metadata["kept_sets"] = encode_kept_sets(np.array([[8]], dtype=np.int32))
    with pytest.raises(ValueError, match="kept sets for 1 tokens, expected 2"):
        groups_to_batch(groups, "grpo", tp=4)
