"""Entropy of the policy's next-token distribution from logits, also when the vocabulary is split over ranks."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

Reduce = Callable[[Tensor], Tensor]


def entropy_from_logits(logits: Tensor, reduce_max: Reduce | None = None, reduce_sum: Reduce | None = None) -> Tensor:
    """Per-position entropy `H = log sum_v exp(z_v) - sum_v p_v z_v` of `softmax(logits)` over the last dim.

    With the vocabulary split over tensor-parallel ranks (each holds `[..., V / tp]`), `reduce_max` and
    `reduce_sum` all-reduce a `[...]` tensor over the split (max for the shift, sum for `sum exp` and
    `sum p z`), so no rank needs the full vocabulary; `reduce_sum` must pass the gradient through unchanged (as
    Megatron's `reduce_from_tensor_model_parallel_region` does) for the entropy bonus. The shift by the max is
    detached: it changes neither value nor gradient.
    """
    shift = logits.detach().amax(dim=-1)
    if reduce_max is not None:
        shift = reduce_max(shift)
    shifted = logits - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    sum_exp_z = (exp * shifted).sum(-1)
    if reduce_sum is not None:
        sum_exp, sum_exp_z = reduce_sum(sum_exp), reduce_sum(sum_exp_z)
    return sum_exp.log() - sum_exp_z / sum_exp
