"""On-policy distillation signals: per-token reverse-KL rewards of a student against a teacher."""

from __future__ import annotations

from torch import Tensor

from megatron_rl.algorithms.masked import as_float, masked_fill_zero


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
