"""Per-token KL estimators between the current policy and a reference policy, and the KL penalty term.

Schulman's estimators (http://joschu.net/blog/kl-approx.html) of KL(current || reference), for tokens sampled
from the current policy, with `log r = ref_logprob - logprob`:

- k1 = -log r                (unbiased, high variance, can be negative)
- k2 = (log r)^2 / 2         (biased, low variance, >= 0)
- k3 = (r - 1) - log r       (unbiased, low variance, >= 0)
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from megatron_rl.algorithms.masked import LossAgg, aggregate_loss, as_float, masked_fill_zero, masked_mean

KLKind = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logprob - ref_logprob, per token."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (logprob - ref_logprob)^2 / 2, per token."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(ref - logprob) - 1 - (ref - logprob), per token (expm1 keeps it exact near 0)."""
    log_r = ref_logprobs - logprobs
    return log_r.expm1() - log_r


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind = "k3") -> Tensor:
    """The per-token estimator named `kind` (`k1`, `k2` or `k3`)."""
    if kind == "k1":
        return kl_k1(logprobs, ref_logprobs)
    if kind == "k2":
        return kl_k2(logprobs, ref_logprobs)
    if kind == "k3":
        return kl_k3(logprobs, ref_logprobs)
    raise ValueError(f"KL estimator {kind!r}: allowed {KL_ESTIMATORS}")


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    kind: KLKind = "k3",
    agg: LossAgg = "token_mean",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`coef` times the aggregated per-token KL estimate, to add to the policy loss, and its stats.

    The gradient flows through `logprobs` only (the reference is detached). Positions outside `mask` are
    replaced by 0 before any arithmetic, so padding may hold anything. Stats: `kl/ref` (the masked token mean of
    the estimate, whatever `agg`) and `kl/penalty` (the returned term), detached 0-d tensors.
    """
    cur = masked_fill_zero(as_float(logprobs), mask)
    ref = masked_fill_zero(as_float(ref_logprobs.detach()), mask)
    per_token = kl_estimate(cur, ref, kind)
    term = coef * aggregate_loss(per_token, mask, agg, normalizer)
    stats = {"kl/ref": masked_mean(per_token.detach(), mask), "kl/penalty": term.detach()}
    return term, stats
