"""Off-policy correction between the proximal policy and the behaviour policy.

The proximal policy's logprobs are recomputed by the trainer at the start of a step (the weights the step
starts from); the behaviour policy's logprobs come from the inference engine that sampled the tokens (an older
weight version, and a different numeric stack). The importance ratio of a token is `exp(proximal - behaviour)`.

Corrections (`AlgorithmConfig.correction`, threshold `is_cap`):

- `none`: weight 1 on every token of the mask.
- `tis`: token-level truncated IS, `w = min(ratio, cap)`.
- `mis`: token-level masked IS, `w = ratio` where `ratio <= cap`; tokens above the cap are masked out (weight 0,
  and removed from the effective mask, so loss averages do not count them).
- `seq_tis` / `seq_mis`: one ratio per sequence, the geometric mean of its token ratios over the mask,
  `exp(mean_t (proximal_t - behaviour_t))`; `seq_tis` truncates it at the cap, `seq_mis` masks out whole
  sequences above the cap. Every token of a sequence carries the sequence's weight.

All weights are detached constants; positions outside the mask have weight 0 and may hold anything (padding).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

from megatron_rl.algorithms.masked import (
    as_bool_mask,
    as_float,
    masked_count,
    masked_fill_zero,
    masked_mean,
)
from megatron_rl.algorithms.metrics import is_weight_stats

Correction = Literal["none", "tis", "mis", "seq_tis", "seq_mis"]
CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "seq_tis", "seq_mis")


@dataclasses.dataclass(frozen=True)
class ImportanceWeights:
    """The result of an off-policy correction."""

    weights: Tensor
    """`[batch, seq]` float weights, detached; 0 outside the effective mask."""
    mask: Tensor
    """`[batch, seq]` bool effective mask: the input mask minus the tokens the correction masked out."""
    stats: dict[str, Tensor]
    """Detached 0-d tensors: `is/truncated_frac`, `is/masked_frac` (of tokens, or of non-empty sequences for the
    sequence-level corrections), and the weight mean/min/max/ESS over the effective mask."""


def token_log_ratio(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """`proximal - behaviour` per token under the mask, 0 outside, detached, float32 or wider."""
    prox = masked_fill_zero(as_float(proximal_logprobs.detach()), mask)
    behav = masked_fill_zero(as_float(behaviour_logprobs.detach()), mask)
    return prox - behav


def sequence_log_ratio(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Log of the geometric mean of token ratios per sequence, `[batch]`: mean of `proximal - behaviour` over
    the sequence's masked tokens (0 for an all-masked sequence)."""
    return masked_mean(token_log_ratio(proximal_logprobs, behaviour_logprobs, mask), mask, dim=-1)


def _result(weights: Tensor, mask: Tensor, truncated: Tensor, masked: Tensor) -> ImportanceWeights:
    """Package weights, effective mask and stats (fractions already computed)."""
    weights = masked_fill_zero(weights, mask)
    stats = {"is/truncated_frac": truncated, "is/masked_frac": masked, **is_weight_stats(weights, mask)}
    return ImportanceWeights(weights=weights, mask=mask, stats=stats)


def _fraction(flags: Tensor, mask: Tensor, like: Tensor) -> Tensor:
    """Fraction of the mask's entries where `flags` holds (0 for an empty mask), in the dtype of `like`."""
    m = as_bool_mask(mask)
    return (flags & m).sum().to(like.dtype) / masked_count(m).clamp(min=1).to(like.dtype)


def no_correction(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> ImportanceWeights:
    """Weight 1 on every masked token (the behaviour policy is ignored)."""
    m = as_bool_mask(mask)
    weights = torch.ones(m.shape, dtype=as_float(proximal_logprobs).dtype, device=m.device)
    zero = torch.zeros((), dtype=weights.dtype, device=m.device)
    return _result(weights, m, zero, zero)


def token_tis(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> ImportanceWeights:
    """Token-level truncated IS: `w = min(exp(proximal - behaviour), cap)`; a ratio equal to the cap is not
    counted as truncated."""
    m = as_bool_mask(mask)
    ratio = token_log_ratio(proximal_logprobs, behaviour_logprobs, m).exp()
    over = ratio > cap
    zero = torch.zeros((), dtype=ratio.dtype, device=m.device)
    return _result(ratio.clamp(max=cap), m, _fraction(over, m, ratio), zero)


def token_mis(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> ImportanceWeights:
    """Token-level masked IS: `w = exp(proximal - behaviour)` where it is <= cap; tokens above are masked out."""
    m = as_bool_mask(mask)
    ratio = token_log_ratio(proximal_logprobs, behaviour_logprobs, m).exp()
    over = ratio > cap
    zero = torch.zeros((), dtype=ratio.dtype, device=m.device)
    return _result(ratio, m & ~over, zero, _fraction(over, m, ratio))


def seq_tis(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> ImportanceWeights:
    """Sequence-level truncated IS: each sequence weighs `min(geometric mean of its token ratios, cap)`."""
    m = as_bool_mask(mask)
    ratio = sequence_log_ratio(proximal_logprobs, behaviour_logprobs, m).exp()
    nonempty = m.any(-1)
    over = ratio > cap
    zero = torch.zeros((), dtype=ratio.dtype, device=m.device)
    weights = ratio.clamp(max=cap)[:, None].expand(m.shape)
    return _result(weights, m, _fraction(over, nonempty, ratio), zero)


def seq_mis(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float) -> ImportanceWeights:
    """Sequence-level masked IS: each sequence weighs the geometric mean of its token ratios; sequences whose
    weight is above the cap are masked out whole."""
    m = as_bool_mask(mask)
    ratio = sequence_log_ratio(proximal_logprobs, behaviour_logprobs, m).exp()
    nonempty = m.any(-1)
    over = ratio > cap
    zero = torch.zeros((), dtype=ratio.dtype, device=m.device)
    weights = ratio[:, None].expand(m.shape)
    return _result(weights, m & ~over[:, None], zero, _fraction(over, nonempty, ratio))


def importance_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    correction: Correction = "tis",
    cap: float = 2.0,
) -> ImportanceWeights:
    """The correction named by `AlgorithmConfig.correction`, with threshold `cap` (`is_cap`)."""
    if correction == "none":
        return no_correction(proximal_logprobs, behaviour_logprobs, mask)
    funcs = {"tis": token_tis, "mis": token_mis, "seq_tis": seq_tis, "seq_mis": seq_mis}
    if correction not in funcs:
        raise ValueError(f"correction {correction!r}: allowed {CORRECTIONS}")
    if not cap > 0:
        raise ValueError(f"is_cap={cap}: must be > 0")
    return funcs[correction](proximal_logprobs, behaviour_logprobs, mask, cap)
