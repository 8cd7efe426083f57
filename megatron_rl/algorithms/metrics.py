"""Diagnostics of a step: train-vs-rollout mismatch and the health of importance weights (detached tensors)."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algorithms.masked import as_float, masked_count, masked_fill_zero, masked_max, masked_mean, masked_min


def mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the trainer's logprobs are from the engine's on the same tokens (detached 0-d tensors).

    `mismatch/k3_kl`: Schulman's k3 estimate of KL(rollout || trainer) (the tokens were sampled by the rollout
    engine): mean over the mask of `r - 1 - log r` with `r = exp(train - rollout)`, `log r` clamped to [-20, 20].
    `mismatch/abs_diff_mean`, `mismatch/abs_diff_max`: mean and max of `|train - rollout|` over the mask.
    """
    train = masked_fill_zero(as_float(train_logprobs.detach()), mask)
    rollout = masked_fill_zero(as_float(rollout_logprobs.detach()), mask)
    log_r = train - rollout
    bounded = log_r.clamp(-20.0, 20.0)  # as kl.kl_k3 (without its value clamp): a wild token stays finite
    k3 = torch.expm1(bounded) - bounded
    abs_diff = log_r.abs()
    return {
        "mismatch/k3_kl": masked_mean(k3, mask),
        "mismatch/abs_diff_mean": masked_mean(abs_diff, mask),
        "mismatch/abs_diff_max": masked_max(abs_diff, mask),
    }


def fresh_mismatch_metrics(
    start_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, versions: Tensor, version: int
) -> dict[str, Tensor]:
    """Train-vs-rollout mismatch apart from staleness drift (detached 0-d tensors): `mismatch_metrics` over the
    response tokens the engine sampled with weights of exactly `version`, the weights that computed
    `start_logprobs` (the batch's first forward), so only the two stacks' numerics (and, without the engine's
    routes or kept sets, routing and mask differences) separate them.

    `versions` `[B, S-1]` holds each position's weight version (`TrainBatch.versions`). Keys:
    `mismatch/fresh_k3_kl`, `mismatch/fresh_abs_diff_mean`, `mismatch/fresh_abs_diff_max` (0 when no token is
    fresh), `mismatch/fresh_tokens` (how many are) and `mismatch/fresh_frac` (their share of the mask's tokens).
    """
    mask = mask if mask.dtype == torch.bool else mask != 0
    fresh = mask & (versions.to(mask.device) == version)
    all_tokens = mismatch_metrics(start_logprobs, rollout_logprobs, fresh)
    count = masked_count(fresh).double()
    return {
        "mismatch/fresh_k3_kl": all_tokens["mismatch/k3_kl"],
        "mismatch/fresh_abs_diff_mean": all_tokens["mismatch/abs_diff_mean"],
        "mismatch/fresh_abs_diff_max": all_tokens["mismatch/abs_diff_max"],
        "mismatch/fresh_tokens": count,
        "mismatch/fresh_frac": count / masked_count(mask).double().clamp(min=1.0),
    }


def effective_sample_size(weights: Tensor, mask: Tensor) -> Tensor:
    """Normalised effective sample size of importance weights over the mask: (sum w)^2 / (sum w^2) / n.

    1 when all weights are equal, 1/n when one weight carries everything; 0 for an empty mask or all-zero
    weights. Weights of tokens that a correction masked out should be outside `mask` (pass the effective mask).
    """
    w = masked_fill_zero(as_float(weights.detach()), mask)
    n = masked_count(mask).to(w.dtype)
    s1, s2 = w.sum(), (w * w).sum()
    ok = (s2 > 0) & (n > 0)
    return torch.where(ok, s1 * s1 / torch.where(ok, s2 * n, torch.ones_like(s2)), torch.zeros_like(s2))


def is_weight_stats(weights: Tensor, mask: Tensor, prefix: str = "is/") -> dict[str, Tensor]:
    """Mean, min, max and normalised ESS of importance weights over the mask (detached 0-d tensors)."""
    w = as_float(weights.detach())
    return {
        f"{prefix}weight_mean": masked_mean(w, mask),
        f"{prefix}weight_min": masked_min(w, mask),
        f"{prefix}weight_max": masked_max(w, mask),
        f"{prefix}ess": effective_sample_size(w, mask),
    }
