"""Per-token KL estimators between the current policy and a reference policy, the KL loss term and the KL
reward penalty.

Schulman's estimators (http://joschu.net/blog/kl-approx.html) of KL(current || reference), for tokens sampled
from the current policy, with `log r = ref_logprob - logprob`:

- k1 = -log r                (unbiased, high variance, can be negative)
- k2 = (log r)^2 / 2         (biased, low variance, >= 0)
- k3 = (r - 1) - log r       (unbiased, low variance, >= 0)

As losses they differ in their expected gradient: k2's is the gradient of KL(current || reference); k3's is the
gradient of the forward KL(reference || current), and k1's is 0. `k3+` (verl's straight-through form) has k3's
value and k2's gradient. k3 is computed as verl does: `log r` clamped to [-20, 20] and the estimate to [-10, 10],
so it stays finite (with a finite gradient) for any log ratio.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from megatron_rl.algorithms.masked import LossAgg, aggregate_loss, as_float, masked_fill_zero, masked_mean, masked_sum

KLKind = Literal["k1", "k2", "k3", "k3+"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "k3+")
K3_LOG_RATIO_BOUND = 20.0
"""verl's clamp of `ref - logprob` before `exp` in k3."""
K3_VALUE_BOUND = 10.0
"""verl's clamp of the k3 estimate."""


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logprob - ref_logprob, per token."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (logprob - ref_logprob)^2 / 2, per token."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(d) - 1 - d with d = ref - logprob clamped to [-20, 20], the result clamped to [-10, 10] (verl's
    `low_var_kl`; expm1 keeps it exact near 0)."""
    log_r = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (log_r.expm1() - log_r).clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)


def kl_k3_k2_grad(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """`k3+`: the value of k3 with the gradient of k2 (straight through: k2 - sg(k2) + sg(k3))."""
    k2 = kl_k2(logprobs, ref_logprobs)
    return k2 - k2.detach() + kl_k3(logprobs, ref_logprobs).detach()


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """The per-token estimator named `kind` (`k1`, `k2`, `k3` or `k3+`)."""
    funcs = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "k3+": kl_k3_k2_grad}
    if kind not in funcs:
        raise ValueError(f"KL estimator {kind!r}: allowed {KL_ESTIMATORS}")
    return funcs[kind](logprobs, ref_logprobs)


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    kind: KLKind = "k3",
    agg: LossAgg = "token_mean",
    normalizer: float | Tensor | None = None,
    norm_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`coef` times the aggregated per-token KL estimate, to add to the policy loss, and its stats.

    The gradient flows through `logprobs` only (the reference is detached). Positions outside `mask` are
    replaced by 0 before any arithmetic, so padding may hold anything. Stats: `kl/ref` (the masked token mean of
    the estimate, whatever `agg`) and `kl/penalty` (the returned term), detached 0-d tensors.
    """
    cur = masked_fill_zero(as_float(logprobs), mask)
    ref = masked_fill_zero(as_float(ref_logprobs.detach()), mask)
    per_token = kl_estimate(cur, ref, kind)
    term = coef * aggregate_loss(per_token, mask, agg, normalizer, norm_tokens)
    stats = {"kl/ref": masked_mean(per_token.detach(), mask), "kl/penalty": term.detach()}
    return term, stats


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: KLKind = "k1") -> Tensor:
    """Per-sequence KL estimate `[batch]`: the sum over the sequence's masked tokens of the estimator (detached).

    Subtracted (times a coefficient) from a sequence's reward, it is the KL-in-reward penalty of PPO for RLHF
    (Ouyang et al. 2022) with the reward at the last token, summed over the response.
    """
    cur = masked_fill_zero(as_float(logprobs.detach()), mask)
    ref = masked_fill_zero(as_float(ref_logprobs.detach()), mask)
    return masked_sum(kl_estimate(cur, ref, kind).detach(), mask, dim=-1)
