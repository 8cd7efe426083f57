"""Turn the rollout buffer's groups into the trainer's batch: padded tokens, response mask, advantages,
behaviour logprobs; plus the rollout statistics of that batch. Pure tensor code (no process groups).
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.rollout.types import Group
from megatron_rl.trainer.batch import TrainBatch


def pad_length(longest: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that holds `longest` tokens."""
    return max(multiple, math.ceil(longest / multiple) * multiple)


def groups_to_batch(groups: list[Group], advantage: str, tp: int, pad_id: int = 0) -> TrainBatch:
    """One sequence per sample: tokens = prompt + response (right-padded to a multiple of `tp`), the mask on the
    positions that predict response tokens, the engine's logprobs there, and group-relative advantages."""
    samples = [s for g in groups for s in g.samples]
    seq = pad_length(max(len(s.prompt_ids) + len(s.response_ids) for s in samples), max(tp, 2))
    tokens = torch.full((len(samples), seq), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), seq - 1)
    behaviour = torch.zeros(len(samples), seq - 1)
    for row, sample in enumerate(samples):
        ids = list(sample.prompt_ids) + list(sample.response_ids)
        tokens[row, : len(ids)] = torch.tensor(ids)
        start = len(sample.prompt_ids) - 1  # position t predicts token t + 1
        end = start + len(sample.response_ids)
        mask[row, start:end] = 1.0
        behaviour[row, start:end] = torch.tensor(sample.logprobs, dtype=torch.float32)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    advantages = compute_advantages(advantage, rewards, group_ids=group_ids)
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=torch.long)
    return TrainBatch(
        tokens=tokens, loss_mask=mask, advantages=advantages, behaviour_logprobs=behaviour, lengths=lengths
    )


def rollout_stats(groups: list[Group], trainer_version: int) -> dict:
    """Reward, length and staleness figures of a batch of groups."""
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    staleness = Counter(g.staleness(trainer_version) for g in groups)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "reward/max": float(rewards.max()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "rollout/groups": len(groups),
        "rollout/samples": len(samples),
        "rollout/tokens": int(lengths.sum()),
        "staleness/mean": sum(k * v for k, v in staleness.items()) / max(1, len(groups)),
        "staleness/max": max(staleness) if staleness else 0,
        "staleness/histogram": {str(k): v for k, v in sorted(staleness.items())},
        "rollout/stale_corrected": sum(bool(g.stale) for g in groups),
    }
