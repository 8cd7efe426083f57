"""On-policy distillation signals: per-token reverse-KL rewards of a student against a teacher, the per-token
advantage that mixes them with the task reward's, and the reverse-KL figures a step reports.

Both logprobs are of the untempered, untruncated distributions (temperature 1, no top-k / top-p): the teacher's
come from vLLM prompt logprobs, which are never tempered, so the student's must be computed the same way."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algorithms.advantages import broadcast_to_tokens
from megatron_rl.algorithms.masked import as_float, masked_count, masked_fill_zero, masked_max, masked_sum


def reverse_kl_rewards(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token on-policy distillation reward `teacher_logprob - student_logprob` (0 outside mask, detached).

    On tokens sampled from the student this is minus the single-sample estimate of the reverse KL
    KL(student || teacher) at that position; used as a token-level advantage it pulls the student to the teacher.
    """
    diff = as_float(teacher_logprobs.detach()) - as_float(student_logprobs.detach())
    return masked_fill_zero(diff, mask)


def sequence_reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence estimate of the reverse KL, sum over masked tokens of `student - teacher` (`[batch]`)."""
    return -reverse_kl_rewards(student_logprobs, teacher_logprobs, mask).sum(-1)


def distill_advantages(
    reward_advantages: Tensor,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    use_reward: bool = True,
) -> Tensor:
    """Per-token advantages `[batch, seq]`: `use_reward * A_reward - kl_coef * (student - teacher)`, detached,
    0 outside `mask`.

    `reward_advantages` is `[batch]` (one per sequence, broadcast over its tokens) or `[batch, seq]`; with
    `use_reward` False it is left out (pure distillation). The result is what the policy loss takes as its
    advantages, under its usual importance correction.
    """
    distill = kl_coef * reverse_kl_rewards(student_logprobs, teacher_logprobs, mask)
    if not use_reward:
        return distill
    base = reward_advantages if reward_advantages.dim() == 2 else broadcast_to_tokens(reward_advantages, mask)
    return masked_fill_zero(as_float(base.detach()).to(distill.dtype) + distill, mask)


def reverse_kl_sums(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """`[sum of (student - teacher), tokens, sum of k3, max |student - teacher|]` (float64) over the masked tokens:
    the parts of `distill/reverse_kl` (sum / tokens), `distill/k3_kl` (k3 sum / tokens) and
    `distill/reverse_kl_abs_max`, summed (the first three) and maxed (the last) over data-parallel shares.

    k3 = exp(r) - 1 - r with r = teacher - student is Schulman's estimator of the same KL(student || teacher) on
    the student's samples: never negative, and of far lower variance than the mean of -r when the two are close."""
    diff = student_logprobs.detach().double() - teacher_logprobs.detach().double()
    k3 = torch.expm1(-diff) + diff
    return torch.stack(
        [masked_sum(diff, mask), masked_count(mask).double(), masked_sum(k3, mask), masked_max(diff.abs(), mask)]
    )


def top_k_kl(student_top: Tensor, teacher_top: Tensor, kind: str, floor: float = -1e29) -> Tensor:
    """Per position KL `[...]` on the teacher's top k tokens (`[..., k]` logprobs of the same ids), both
    distributions renormalised on them: `forward` KL(teacher || student), `reverse` KL(student || teacher).
    Entries whose teacher logprob is below `floor` (padding: the engine returned fewer) weigh nothing."""
    if kind not in ("forward", "reverse"):
        raise ValueError(f"top-k KL kind {kind!r}: expected forward or reverse")
    real = teacher_top > floor
    # Finite stand-ins keep the softmax and its gradient free of inf - inf where an entry is padding.
    t = torch.where(real, teacher_top.float(), floor).log_softmax(-1)
    s = torch.where(real, student_top.float(), floor).log_softmax(-1)
    p, q = (t, s) if kind == "forward" else (s, t)
    return torch.where(real, p.exp() * (p - q), torch.zeros_like(p)).sum(-1)
