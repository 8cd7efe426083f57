"""Group-relative advantages per sequence: GRPO (Shao et al. 2024, DeepSeekMath), GRPO without the std
normalisation (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-like training"), and RLOO (Ahmadian et al.
2024, "Back to basics").

Groups are given either as `group_ids` (a LongTensor `[batch]`, any integer labels, any order) or as a fixed
`group_size` (consecutive runs of `group_size` sequences form one group). A group of size 1, and a group whose
rewards are all equal (zero variance), get advantage exactly 0.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_rl.algorithms.masked import as_float, masked_fill_zero

AdvantageKind = Literal["grpo", "grpo_no_std", "rloo"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "grpo_no_std", "rloo")


def group_index(batch: int, group_ids: Tensor | None = None, group_size: int | None = None) -> tuple[Tensor, int]:
    """Dense group index `[batch]` (values 0..G-1) and the number of groups G, from ids or a fixed size."""
    if (group_ids is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids and group_size")
    if group_ids is not None:
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({batch},)")
        uniq, index = torch.unique(group_ids, return_inverse=True)
        return index, int(uniq.numel())
    if group_size < 1 or batch % group_size:
        raise ValueError(f"group_size={group_size}: must be positive and divide the batch ({batch})")
    return torch.arange(batch) // group_size, batch // group_size


def _group_stats(rewards: Tensor, index: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence group size, group sum and whether the group's rewards are all equal."""
    index = index.to(rewards.device)
    count = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, index, torch.ones_like(rewards)
    )
    total = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, index, rewards)
    hi = torch.full((groups,), float("-inf"), dtype=rewards.dtype, device=rewards.device)
    lo = torch.full((groups,), float("inf"), dtype=rewards.dtype, device=rewards.device)
    hi = hi.scatter_reduce(0, index, rewards, "amax")
    lo = lo.scatter_reduce(0, index, rewards, "amin")
    return count[index], total[index], (hi == lo)[index]


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    group_size: int | None = None,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantage per sequence: (r - group mean) / (group std + eps), or r - group mean without std (Dr.
    GRPO: the std term biases towards groups of nearly equal rewards).

    The std is the sample std (Bessel-corrected, n - 1), as torch.std, verl and TRL compute it. Returns a float
    tensor `[batch]` (float32 or wider), detached.
    """
    r = as_float(rewards.detach())
    index, groups = group_index(r.shape[0], group_ids, group_size)
    count, total, constant = _group_stats(r, index, groups)
    mean = total / count
    centred = r - mean
    if normalize_std:
        index = index.to(r.device)
        sq = torch.zeros(groups, dtype=r.dtype, device=r.device).index_add_(0, index, centred.square())[index]
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    return torch.where(constant | (count < 2), torch.zeros_like(centred), centred)


def rloo_advantages(rewards: Tensor, group_ids: Tensor | None = None, group_size: int | None = None) -> Tensor:
    """RLOO advantage per sequence: r_i minus the mean reward of the other members of its group.

    Equal to n/(n-1) (r_i - group mean). Groups of size 1 (no others) and zero-variance groups give 0.
    """
    r = as_float(rewards.detach())
    index, groups = group_index(r.shape[0], group_ids, group_size)
    count, total, constant = _group_stats(r, index, groups)
    adv = r - (total - r) / (count - 1).clamp(min=1)
    return torch.where(constant | (count < 2), torch.zeros_like(adv), adv)


def compute_advantages(
    kind: AdvantageKind,
    rewards: Tensor,
    group_ids: Tensor | None = None,
    group_size: int | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """The estimator named by `AlgorithmConfig.advantage`: `grpo`, `grpo_no_std` or `rloo`. Rewards are used in
    their own dtype (float64 stays float64: the trainer passes float64 so that large rewards keep their spread)."""
    if kind == "grpo":
        return grpo_advantages(rewards, group_ids, group_size, eps=eps)
    if kind == "grpo_no_std":
        return grpo_advantages(rewards, group_ids, group_size, normalize_std=False)
    if kind == "rloo":
        return rloo_advantages(rewards, group_ids, group_size)
    raise ValueError(f"advantage estimator {kind!r}: allowed {ADVANTAGE_ESTIMATORS}")


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence advantages `[batch]` as per-token `[batch, seq]`: the sequence's value under the mask, 0 off."""
    adv = as_float(advantages.detach())
    return masked_fill_zero(adv[:, None].expand(mask.shape), mask)
