"""Off-policy correction between the proximal policy and the behaviour policy.

The proximal policy's logprobs are those of the weights a batch starts from (recomputed by the trainer, or taken
from the training forward itself when a batch has one mini-batch); the behaviour policy's logprobs come from the
inference engine that sampled the tokens (an older weight version, and a different numeric stack). The token
ratio is `r_t = exp(proximal_t - behaviour_t)`; every log ratio is clamped to [-20, 20] before `exp` (as verl
does), so no weight overflows.

Corrections (`AlgorithmConfig.correction`; upper bound C = `is_cap`, lower bound `is_cap_low`):

- `none`: weight 1 on every token of the mask.
- `tis`: token-level truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
  RL training"): `w_t = min(r_t, C)`, or `clip(r_t, low, C)` with a lower bound.
- `mis`: token-level masked IS (ICEPOP, "Every step evolves", Ling team 2025; verl's token rejection): `w_t = r_t`
  where `low <= r_t <= C` (low defaults to 1/C), and the token is masked out elsewhere.
- `seq_tis` / `seq_mis`: sequence-level IS, one ratio per sequence, the product of its token ratios
  `R = exp(sum_t log r_t)` (verl's and slime's `sequence`): truncated at C, or masking the whole sequence outside
  [low, C]. Every token of a sequence carries the sequence's weight.
- `geo_tis` / `geo_mis`: the same with the geometric mean `G = exp(mean_t log r_t)` (verl's `geo`, slime's
  `geometric`; what `seq_tis`/`seq_mis` meant before).

On top of any correction, a veto (verl's catastrophic-token veto) masks out whole sequences whose largest token
ratio exceeds `veto_max` or whose smallest falls below `veto_min`.

All weights are detached constants; positions outside the mask have weight 0 and may hold anything (padding).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

from megatron_rl.algorithms.masked import as_bool_mask, as_float, masked_count, masked_fill_zero, masked_mean
from megatron_rl.algorithms.metrics import is_weight_stats

Correction = Literal["none", "tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis"]
CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis")
MAX_LOG_RATIO = 20.0
"""Bound on every log ratio before `exp` (exp(20) ~ 4.9e8), as verl's SAFETY_BOUND."""


@dataclasses.dataclass(frozen=True)
class ImportanceWeights:
    """The result of an off-policy correction."""

    weights: Tensor
    """`[batch, seq]` float weights, detached; 0 outside the kept mask."""
    mask: Tensor
    """`[batch, seq]` bool kept mask: the input mask minus the tokens the correction (or the veto) masked out."""
    stats: dict[str, Tensor]
    """Detached 0-d tensors: `is/truncated_frac`, `is/masked_frac` (of tokens, or of non-empty sequences for the
    sequence-level corrections), `is/vetoed_frac` (of non-empty sequences), and the weight mean/min/max/ESS over
    the kept mask."""


def token_log_ratio(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """`proximal - behaviour` per token under the mask, 0 outside, detached, float32 or wider.

    Where both are equal the log ratio is exactly 0, also when both are -inf (a token both policies call
    impossible: the ratio is 1, not NaN).
    """
    prox = masked_fill_zero(as_float(proximal_logprobs.detach()), mask)
    behav = masked_fill_zero(as_float(behaviour_logprobs.detach()), mask)
    return torch.where(prox == behav, torch.zeros((), dtype=prox.dtype, device=prox.device), prox - behav)


def sequence_log_ratio(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Log of the product of token ratios per sequence, `[batch]`: the sum of `proximal - behaviour` over the
    sequence's masked tokens (0 for an all-masked sequence), unclamped."""
    return token_log_ratio(proximal_logprobs, behaviour_logprobs, mask).sum(-1)


def geometric_log_ratio(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Log of the geometric mean of token ratios per sequence, `[batch]`: the mean of `proximal - behaviour`
    over the sequence's masked tokens (0 for an all-masked sequence), unclamped."""
    return masked_mean(token_log_ratio(proximal_logprobs, behaviour_logprobs, mask), mask, dim=-1)


def safe_exp(log_ratio: Tensor) -> Tensor:
    """`exp` of a log ratio clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO]."""
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def _fraction(flags: Tensor, units: Tensor, like: Tensor) -> Tensor:
    """Fraction of the `units` entries (a bool mask) where `flags` holds (0 for no units), in the dtype of `like`."""
    return (flags & units).sum().to(like.dtype) / masked_count(units).clamp(min=1).to(like.dtype)


def _bounds(correction: str, cap: float, cap_low: float | None) -> tuple[float, float]:
    """(lower, upper) bound of the ratio: a mask defaults its lower bound to 1/cap, a truncation to none (0)."""
    if not cap > 0:
        raise ValueError(f"is_cap={cap}: must be > 0")
    if cap_low is None:
        return (1.0 / cap if correction.endswith("mis") else 0.0), cap
    if not 0 <= cap_low <= cap:
        raise ValueError(f"is_cap_low={cap_low}: must be in [0, is_cap={cap}]")
    return cap_low, cap


def _token_correction(
    log_r: Tensor, mask: Tensor, truncate: bool, low: float, high: float
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Token-level TIS (truncate) or MIS (mask): weights, kept mask, fractions over tokens."""
    ratio = safe_exp(log_r)
    outside = (ratio > high) | (ratio < low)
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    if truncate:
        return (
            ratio.clamp(low, high),
            mask,
            {"is/truncated_frac": _fraction(outside, mask, ratio), "is/masked_frac": zero},
        )
    return ratio, mask & ~outside, {"is/truncated_frac": zero, "is/masked_frac": _fraction(outside, mask, ratio)}


def _sequence_correction(
    seq_log_r: Tensor, mask: Tensor, truncate: bool, low: float, high: float
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Sequence-level TIS or MIS from one log ratio per sequence: weights, kept mask, fractions over sequences."""
    ratio = safe_exp(seq_log_r)
    nonempty = mask.any(-1)
    outside = (ratio > high) | (ratio < low)
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    if truncate:
        weights = ratio.clamp(low, high)[:, None].expand(mask.shape)
        return weights, mask, {"is/truncated_frac": _fraction(outside, nonempty, ratio), "is/masked_frac": zero}
    weights = ratio[:, None].expand(mask.shape)
    return (
        weights,
        mask & ~outside[:, None],
        {"is/truncated_frac": zero, "is/masked_frac": _fraction(outside, nonempty, ratio)},
    )


def veto_sequences(log_r: Tensor, mask: Tensor, veto_max: float | None, veto_min: float | None) -> Tensor:
    """`[batch]` bool: sequences with a masked token whose ratio exceeds `veto_max` or falls below `veto_min`."""
    m = as_bool_mask(mask)
    vetoed = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    ratio = safe_exp(log_r)
    if veto_max is not None:
        vetoed |= (m & (ratio > veto_max)).any(-1)
    if veto_min is not None:
        vetoed |= (m & (ratio < veto_min)).any(-1)
    return vetoed


def importance_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    correction: Correction = "tis",
    cap: float = 2.0,
    cap_low: float | None = None,
    veto_max: float | None = None,
    veto_min: float | None = None,
) -> ImportanceWeights:
    """The correction named by `AlgorithmConfig.correction` (module docstring), bounds [`cap_low`, `cap`], then
    the veto of whole sequences by their largest (`veto_max`) or smallest (`veto_min`) token ratio."""
    if correction not in CORRECTIONS:
        raise ValueError(f"correction {correction!r}: allowed {CORRECTIONS}")
    m = as_bool_mask(mask)
    log_r = token_log_ratio(proximal_logprobs, behaviour_logprobs, m)
    if correction == "none":
        weights = torch.ones(m.shape, dtype=log_r.dtype, device=m.device)
        zero = torch.zeros((), dtype=log_r.dtype, device=m.device)
        kept, stats = m, {"is/truncated_frac": zero, "is/masked_frac": zero}
    elif correction in ("tis", "mis"):
        weights, kept, stats = _token_correction(log_r, m, correction == "tis", *_bounds(correction, cap, cap_low))
    else:
        count = masked_count(m, dim=-1).clamp(min=1).to(log_r.dtype)
        seq_log_r = log_r.sum(-1) if correction.startswith("seq") else log_r.sum(-1) / count
        truncate = correction.endswith("tis")
        weights, kept, stats = _sequence_correction(seq_log_r, m, truncate, *_bounds(correction, cap, cap_low))
    vetoed = veto_sequences(log_r, m, veto_max, veto_min)
    kept = kept & ~vetoed[:, None]
    stats["is/vetoed_frac"] = _fraction(vetoed, m.any(-1), log_r)
    weights = masked_fill_zero(weights, kept)
    return ImportanceWeights(weights=weights, mask=kept, stats={**stats, **is_weight_stats(weights, kept)})
