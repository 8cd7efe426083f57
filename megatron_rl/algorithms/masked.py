"""Masked reductions and loss aggregation: the base module of `algorithms/` (it imports nothing from the package).

A mask is a `[batch, seq]` tensor, bool or 0/1 numbers: a token counts where it is nonzero. Values at positions
outside the mask are never read (they may be NaN or inf: padding).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def as_bool_mask(mask: Tensor) -> Tensor:
    """`mask` as a bool tensor: True where the token counts (nonzero)."""
    return mask if mask.dtype == torch.bool else mask != 0


def as_float(x: Tensor) -> Tensor:
    """`x` in float32 or wider (float64 stays float64; bf16, fp16 and integers become float32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """`x` where the mask holds, 0 elsewhere (NaN/inf padding is dropped, and gets no gradient)."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over the mask: all of it (`dim=None`) or along `dim`."""
    z = masked_fill_zero(x, mask)
    return z.sum() if dim is None else z.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of tokens in the mask (int64): all of it or along `dim`."""
    m = as_bool_mask(mask)
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the mask, all of it or along `dim`; 0 where the mask is empty."""
    count = masked_count(mask, dim).clamp(min=1).to(x.dtype)
    return masked_sum(x, mask, dim) / count


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Max (or min) of floating `x` over the whole mask, 0 when the mask is empty; no host sync."""
    m = as_bool_mask(mask)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return zero
    fill = torch.tensor(float("-inf") if largest else float("inf"), dtype=x.dtype, device=x.device)
    filled = torch.where(m, x, fill)
    extreme = filled.amax() if largest else filled.amin()
    return torch.where(m.any(), extreme, zero)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Largest `x` (floating) over the whole mask; 0 when the mask is empty."""
    return _masked_extreme(x, mask, largest=True)


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    """Smallest `x` (floating) over the whole mask; 0 when the mask is empty."""
    return _masked_extreme(x, mask, largest=False)


def loss_numerator(token_loss: Tensor, mask: Tensor, agg: LossAgg = "token_mean") -> Tensor:
    """The sum an aggregation divides by its denominator (`loss_denominator`); shares of a batch add up.

    `token_mean`, `seq_mean_token_sum` and `seq_mean_token_sum_norm` sum every masked token's loss; `seq_mean`
    sums each sequence's mean over its masked tokens.
    """
    if agg == "seq_mean":
        return masked_sum(masked_mean(token_loss, mask, dim=-1), masked_count(mask, dim=-1) > 0)
    if agg in ("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        return masked_sum(token_loss, mask)
    raise ValueError(f"loss aggregation {agg!r}: allowed {LOSS_AGGREGATIONS}")


def loss_denominator(mask: Tensor, agg: LossAgg = "token_mean", norm_tokens: int | None = None) -> Tensor:
    """This share's contribution (float64, 0-d) to an aggregation's denominator; shares of a batch add up.

    - `token_mean`: the masked tokens.
    - `seq_mean`, `seq_mean_token_sum`: the sequences with at least one masked token.
    - `seq_mean_token_sum_norm` (Dr. GRPO, Liu et al. 2025): every row of the batch times the constant
      `norm_tokens` (the generation budget), so the denominator depends on no response length.
    """
    if agg == "token_mean":
        return masked_count(mask).to(torch.float64)
    if agg in ("seq_mean", "seq_mean_token_sum"):
        return masked_count(masked_count(mask, dim=-1) > 0).to(torch.float64)
    if agg == "seq_mean_token_sum_norm":
        if norm_tokens is None or norm_tokens < 1:
            raise ValueError(
                f"seq_mean_token_sum_norm needs norm_tokens >= 1 (the generation budget), got {norm_tokens}"
            )
        return torch.tensor(float(mask.shape[0] * norm_tokens), dtype=torch.float64)
    raise ValueError(f"loss aggregation {agg!r}: allowed {LOSS_AGGREGATIONS}")


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    agg: LossAgg = "token_mean",
    normalizer: float | Tensor | None = None,
    norm_tokens: int | None = None,
) -> Tensor:
    """Reduce a `[batch, seq]` per-token loss to a scalar; tokens outside `mask` count for nothing.

    - `token_mean`: sum over the masked tokens / number of masked tokens in the batch.
    - `seq_mean` (seq-mean-token-mean): mean over the masked tokens of each sequence, then mean over the sequences
      that have at least one masked token (an all-masked sequence is left out of the count, not averaged in as 0).
    - `seq_mean_token_sum`: sum over each sequence's masked tokens, then mean over those sequences.
    - `seq_mean_token_sum_norm` (Dr. GRPO): sum over every masked token / (rows x `norm_tokens`).

    `normalizer`, when given, replaces the denominator (`loss_denominator`), e.g. the global count over
    gradient-accumulation micro-batches and data-parallel ranks. An empty mask gives 0 (with a zero gradient),
    never NaN.
    """
    total = loss_numerator(token_loss, mask, agg)
    if normalizer is None:
        normalizer = loss_denominator(mask, agg, norm_tokens).clamp(min=1).to(total.dtype)
    return total / normalizer
