"""Policy losses: PPO with asymmetric clipping, and decoupled PPO (proximal trust region + behaviour correction).

Per token, with advantage A and ratio `r = exp(logprob - anchor)`:

    loss_t = -w_t * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)

- `ppo_clip_loss`: anchor = the old (behaviour) logprobs, w = 1.
- `decoupled_ppo_loss` (AReaL, Fu et al. 2025): anchor = the proximal logprobs (recomputed by the trainer at the
  start of the step), and `w` = the behaviour correction `exp(proximal - behaviour)` as truncated/masked by
  `importance.importance_weights` (tokens a masking correction drops leave the effective mask).

The gradient flows through `logprobs` only: anchors, behaviour logprobs, advantages and weights are detached.
Values outside the mask are replaced by 0 before any arithmetic, so padding may hold NaN/inf without reaching
the loss or its gradient. The log ratio is clamped to [-20, 20] before `exp` (as verl does) so a wild token cannot
overflow to inf; inside that range the loss is exact.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_rl.algorithms.importance import Correction, importance_weights
from megatron_rl.algorithms.kl import KLKind, kl_penalty
from megatron_rl.algorithms.masked import (
    LossAgg,
    aggregate_loss,
    as_bool_mask,
    as_float,
    masked_count,
    masked_fill_zero,
    masked_max,
    masked_mean,
    masked_min,
)

PolicyLoss = Literal["ppo", "decoupled_ppo"]
POLICY_LOSSES: tuple[str, ...] = ("ppo", "decoupled_ppo")
MAX_LOG_RATIO = 20.0
"""Bound on |logprob - anchor| before exp (exp(20) ~ 4.9e8)."""


def token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Advantages as `[batch, seq]`, detached, 0 outside the mask: per-sequence `[batch]` ones are broadcast."""
    adv = as_float(advantages.detach())
    if adv.dim() == 1:
        adv = adv[:, None].expand(mask.shape)
    return masked_fill_zero(adv, mask)


def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate loss `-min(r A, clip(r) A)` with `r = exp(logprobs - old)`.

    Returns (token loss `[batch, seq]` with gradient through `logprobs`, detached ratio, bool flags where the
    lower clip is active (A < 0 and r < 1 - clip_low), bool flags where the upper clip is active (A > 0 and
    r > 1 + clip_high)); all are 0/False outside the mask. Where a clip is active the token's gradient is 0.
    """
    m = as_bool_mask(mask)
    cur = masked_fill_zero(as_float(logprobs), m)
    old = masked_fill_zero(as_float(old_logprobs.detach()), m)
    adv = token_advantages(advantages, m)
    ratio = torch.exp((cur - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = masked_fill_zero(-torch.minimum(ratio * adv, clipped * adv), m)
    r = ratio.detach()
    low = m & (adv < 0) & (r < 1.0 - clip_low)
    high = m & (adv > 0) & (r > 1.0 + clip_high)
    return loss, masked_fill_zero(r, m), low, high


def _clip_stats(ratio: Tensor, low: Tensor, high: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Clip fractions, ratio mean/min/max and k3 KL(anchor || current) over the mask (detached 0-d tensors)."""
    m = as_bool_mask(mask)
    count = masked_count(m).clamp(min=1).to(ratio.dtype)
    log_r = torch.where(m, ratio, torch.ones_like(ratio)).log()
    return {
        "ppo/clip_frac": ((low | high) & m).sum().to(ratio.dtype) / count,
        "ppo/clip_frac_low": (low & m).sum().to(ratio.dtype) / count,
        "ppo/clip_frac_high": (high & m).sum().to(ratio.dtype) / count,
        "ppo/ratio_mean": masked_mean(ratio, m),
        "ppo/ratio_min": masked_min(ratio, m),
        "ppo/ratio_max": masked_max(ratio, m),
        "ppo/approx_kl": masked_mean(ratio - 1 - log_r, m),
        "ppo/tokens": masked_count(m).to(ratio.dtype),
    }


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: LossAgg = "token_mean",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped objective with asymmetric clip [1 - clip_low, 1 + clip_high] against `old_logprobs`.

    `advantages` is `[batch]` (one per sequence) or `[batch, seq]`. `agg`/`normalizer` as in
    `metrics.aggregate_loss`. Returns the scalar loss (to minimise) and `ppo/*` stats as detached 0-d tensors.
    """
    m = as_bool_mask(mask)
    token_loss, ratio, low, high = clipped_surrogate(logprobs, old_logprobs, advantages, m, clip_low, clip_high)
    loss = aggregate_loss(token_loss, m, agg, normalizer)
    return loss, _clip_stats(ratio, low, high, m)


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    correction: Correction = "tis",
    is_cap: float = 2.0,
    agg: LossAgg = "token_mean",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO: the clipped surrogate against the proximal policy, times the behaviour correction weight.

    `loss_t = -w_t * min(r_t A_t, clip(r_t) A_t)`, `r_t = exp(logprob_t - proximal_t)`, `w_t` from
    `importance_weights(proximal, behaviour, mask, correction, is_cap)`. The loss is aggregated over the
    correction's effective mask (a masked-out token or sequence counts neither in the sum nor in the
    denominator). Stats: `ppo/*` (over the effective mask) and `is/*`.
    """
    iw = importance_weights(proximal_logprobs, behaviour_logprobs, mask, correction, is_cap)
    token_loss, ratio, low, high = clipped_surrogate(
        logprobs, proximal_logprobs, advantages, iw.mask, clip_low, clip_high
    )
    loss = aggregate_loss(iw.weights * token_loss, iw.mask, agg, normalizer)
    stats = _clip_stats(ratio, low, high, iw.mask)
    return loss, {**stats, **iw.stats}


def policy_loss(
    kind: PolicyLoss,
    logprobs: Tensor,
    proximal_logprobs: Tensor | None,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    correction: Correction = "tis",
    is_cap: float = 2.0,
    agg: LossAgg = "token_mean",
    normalizer: float | Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss named by `AlgorithmConfig.loss`, plus `kl_coef` times the KL penalty to `ref_logprobs`.

    `ppo` clips against the behaviour logprobs (`proximal_logprobs` and `correction` are unused);
    `decoupled_ppo` needs `proximal_logprobs`. The KL term uses the input `mask` and the same `agg`/`normalizer`;
    it is added only when `kl_coef > 0` (then `ref_logprobs` is required). Stats gain `loss/policy` and
    `loss/total`.
    """
    if kind == "ppo":
        loss, stats = ppo_clip_loss(
            logprobs, behaviour_logprobs, advantages, mask, clip_low, clip_high, agg, normalizer
        )
    elif kind == "decoupled_ppo":
        if proximal_logprobs is None:
            raise ValueError("decoupled_ppo needs proximal_logprobs")
        loss, stats = decoupled_ppo_loss(
            logprobs,
            proximal_logprobs,
            behaviour_logprobs,
            advantages,
            mask,
            clip_low,
            clip_high,
            correction,
            is_cap,
            agg,
            normalizer,
        )
    else:
        raise ValueError(f"policy loss {kind!r}: allowed {POLICY_LOSSES}")
    stats["loss/policy"] = loss.detach()
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
        term, kl_stats = kl_penalty(logprobs, ref_logprobs, mask, kl_coef, kl_kind, agg, normalizer)
        loss = loss + term
        stats.update(kl_stats)
    stats["loss/total"] = loss.detach()
    return loss, stats
