"""Per-token policy-gradient surrogates: PPO with asymmetric and dual clipping, decoupled PPO, GSPO and CISPO.

Per token, with advantage A, ratio r against an anchor policy and behaviour weight w:

    ppo / decoupled_ppo:  loss_t = -w_t * min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)
    dual clip (A < 0):    loss_t = min(loss_t, -c A)   (Ye et al. 2020, "Mastering complex control in MOBA games")
    gspo:                 the same with r_t replaced by the sequence ratio s_i = exp(mean_t log r_t) (value) whose
                          gradient is s_i * grad log pi_t (Zheng et al. 2025, "Group sequence policy optimization")
    cispo:                loss_t = -w_t * sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A * log pi_t (MiniMax-M1,
                          2025): the clipped weight never stops a token's gradient

- `ppo`: anchor = the behaviour logprobs, w = 1.
- `decoupled_ppo` (AReaL, Fu et al. 2025): anchor = the proximal logprobs (the weights the batch starts from),
  w = the behaviour correction (`importance.importance_weights`). `gspo` and `cispo` are decoupled alike.

The gradient flows through `logprobs` only: anchors, behaviour logprobs, advantages and weights are detached.
Values outside the mask are replaced by 0 before any arithmetic, so padding may hold NaN/inf without reaching
the loss or its gradient. Log ratios are clamped to [-20, 20] before `exp` (as verl does) so a wild token cannot
overflow to inf; inside that range the loss is exact.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_rl.algorithms.importance import MAX_LOG_RATIO
from megatron_rl.algorithms.masked import (
    as_bool_mask,
    as_float,
    masked_count,
    masked_fill_zero,
    masked_max,
    masked_mean,
    masked_min,
)

PolicyLoss = Literal["ppo", "decoupled_ppo", "gspo", "cispo"]
POLICY_LOSSES: tuple[str, ...] = ("ppo", "decoupled_ppo", "gspo", "cispo")


def token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Advantages as `[batch, seq]`, detached, 0 outside the mask: per-sequence `[batch]` ones are broadcast."""
    adv = as_float(advantages.detach())
    if adv.dim() == 1:
        adv = adv[:, None].expand(mask.shape)
    return masked_fill_zero(adv, mask)


def _inputs(logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor, mask: Tensor):
    """Bool mask, current logprobs (with gradient), detached anchor and token advantages, all 0 off the mask."""
    m = as_bool_mask(mask)
    cur = masked_fill_zero(as_float(logprobs), m)
    anchor = masked_fill_zero(as_float(anchor_logprobs.detach()), m)
    return m, cur, anchor, token_advantages(advantages, m)


def clip_surrogate(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual_clip: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token `-min(r A, clip(r) A)`, with the dual clip `min(., -c A)` where A < 0 when `dual_clip` (c > 1).

    Returns the loss (gradient through `ratio`) and bool flags `low` (A < 0, r < 1 - clip_low), `high` (A > 0,
    r > 1 + clip_high) and `dual` (the dual clip bounds the loss); the gradient is 0 wherever a flag is set.
    """
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    flags = {"low": (adv < 0) & (r < 1.0 - clip_low), "high": (adv > 0) & (r > 1.0 + clip_high)}
    flags["dual"] = torch.zeros_like(flags["low"])
    if dual_clip is not None:
        if not dual_clip > 1:
            raise ValueError(f"dual_clip={dual_clip}: must be > 1")
        bound = -dual_clip * adv
        flags["dual"] = (adv < 0) & (loss.detach() > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, flags


def ppo_token_loss(
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate per token against `anchor_logprobs` (behaviour for `ppo`, proximal for
    `decoupled_ppo`): (token loss `[batch, seq]`, detached ratio, clip flags), all 0/False off the mask."""
    m, cur, anchor, adv = _inputs(logprobs, anchor_logprobs, advantages, mask)
    ratio = torch.exp((cur - anchor).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    loss, flags = clip_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    return masked_fill_zero(loss, m), masked_fill_zero(ratio.detach(), m), {k: v & m for k, v in flags.items()}


def gspo_token_loss(
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """GSPO-token: every token carries its sequence's ratio `s_i = exp(mean_t (logprob - anchor))` as value and
    `s_i * grad logprob_t` as gradient (`log s_it = sg(log s_i) + logprob_t - sg(logprob_t)`); clipped per
    sequence with the paper's narrow range. With `seq_mean` aggregation its gradient is GSPO's
    `-A_i grad s_i` (clip inactive). Returns (token loss, detached sequence ratio per token, clip flags)."""
    m, cur, anchor, adv = _inputs(logprobs, anchor_logprobs, advantages, mask)
    seq_log_ratio = masked_mean((cur - anchor).detach(), m, dim=-1)
    log_s = seq_log_ratio[:, None] + cur - cur.detach()
    ratio = torch.exp(log_s.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    loss, flags = clip_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    return masked_fill_zero(loss, m), masked_fill_zero(ratio.detach(), m), {k: v & m for k, v in flags.items()}


def cispo_token_loss(
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """CISPO per token: `-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprob`; its gradient is
    `-clip(r) A grad logprob` on every token (REINFORCE with a clipped, detached IS weight). Returns (token loss,
    detached ratio, flags `low`/`high` where the weight is clipped; `dual` is all False)."""
    m, cur, anchor, adv = _inputs(logprobs, anchor_logprobs, advantages, mask)
    ratio = torch.exp((cur - anchor).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * cur
    flags = {"low": m & (ratio < 1.0 - clip_low), "high": m & (ratio > 1.0 + clip_high)}
    flags["dual"] = torch.zeros_like(flags["low"])
    return masked_fill_zero(loss, m), masked_fill_zero(ratio, m), flags


def clip_stats(ratio: Tensor, flags: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """Clip fractions, ratio mean/min/max and k3 KL(anchor || current) over the mask (detached 0-d tensors)."""
    m = as_bool_mask(mask)
    count = masked_count(m).clamp(min=1).to(ratio.dtype)
    low, high, dual = flags["low"] & m, flags["high"] & m, flags["dual"] & m
    log_r = torch.where(m, ratio, torch.ones_like(ratio)).log()
    return {
        "ppo/clip_frac": (low | high).sum().to(ratio.dtype) / count,
        "ppo/clip_frac_low": low.sum().to(ratio.dtype) / count,
        "ppo/clip_frac_high": high.sum().to(ratio.dtype) / count,
        "ppo/dual_clip_frac": dual.sum().to(ratio.dtype) / count,
        "ppo/ratio_mean": masked_mean(ratio, m),
        "ppo/ratio_min": masked_min(ratio, m),
        "ppo/ratio_max": masked_max(ratio, m),
        "ppo/approx_kl": masked_mean(ratio - 1 - log_r, m),
        "ppo/tokens": masked_count(m).to(ratio.dtype),
    }
