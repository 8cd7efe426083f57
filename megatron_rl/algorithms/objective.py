"""The whole per-batch objective: the policy loss (`losses.py`) times the behaviour correction
(`importance.py`), aggregated (`masked.py`), plus the KL penalty (`kl.py`) and the entropy bonus.

    loss = agg(w * surrogate) + kl_coef * agg(kl estimate) - entropy_coef * agg(entropy)

The policy term is aggregated over the input mask (`is_normalizer: all`: tokens a masking correction drops count
0 but stay in the denominator, as AReaL and slime do) or over the kept mask (`kept`). The KL and entropy terms
always use the input mask. Each term takes its own global denominator when the batch is split into micro-batches
and data-parallel shares (`normalizer`, `input_normalizer`), so the shares' losses sum to the whole-batch loss.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

from megatron_rl.algorithms.importance import Correction, ImportanceWeights, importance_weights
from megatron_rl.algorithms.kl import KLKind, kl_penalty
from megatron_rl.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLoss,
    cispo_token_loss,
    clip_stats,
    gspo_token_loss,
    ppo_token_loss,
)
from megatron_rl.algorithms.masked import (
    LossAgg,
    aggregate_loss,
    as_bool_mask,
    as_float,
    loss_denominator,
    masked_fill_zero,
    masked_mean,
)
from megatron_rl.algorithms.sampling_mask import SamplingMask

ISNormalizer = Literal["all", "kept"]


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Every setting of the objective (the fields of `AlgorithmConfig` that shape the loss)."""

    kind: PolicyLoss = "decoupled_ppo"
    """`ppo`, `decoupled_ppo`, `gspo` or `cispo` (see `losses.py`)."""
    clip_low: float = 0.2
    """PPO/CISPO lower clip range (ratio >= 1 - clip_low)."""
    clip_high: float = 0.28
    """PPO/CISPO upper clip range (ratio <= 1 + clip_high)."""
    dual_clip: float | None = 3.0
    """Dual-clip bound c > 1 for A < 0 (ppo, decoupled_ppo, gspo); None: off."""
    gspo_clip_low: float = 3e-4
    """GSPO's lower clip range of the sequence ratio."""
    gspo_clip_high: float = 4e-4
    """GSPO's upper clip range of the sequence ratio."""
    correction: Correction = "tis"
    """Behaviour correction (not used by `ppo`)."""
    is_cap: float = 2.0
    """Upper bound C of the correction."""
    is_cap_low: float | None = None
    """Lower bound (None: 1/C for masks, none for truncations)."""
    veto_max: float | None = None
    """Mask out sequences with a token ratio above this."""
    veto_min: float | None = None
    """Mask out sequences with a token ratio below this."""
    is_normalizer: ISNormalizer = "all"
    """Aggregate the policy term over the input mask (`all`) or the kept mask (`kept`)."""
    agg: LossAgg = "token_mean"
    """Loss aggregation."""
    norm_tokens: int | None = None
    """The constant token count of `seq_mean_token_sum_norm` (the generation budget)."""
    kl_coef: float = 0.0
    """Coefficient of the KL loss term (0: none)."""
    kl_kind: KLKind = "k3"
    """KL estimator of the loss term."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (0: entropy is a metric only)."""
    top_kl: str = ""
    """On-policy distillation's top-k KL loss term (`distill.loss: topk_*`): `forward` or `reverse`; empty: none."""
    top_kl_coef: float = 0.0
    """Its weight (`distill.kl_coef`), on the token mean over the input mask."""
    temperature: float = 1.0
    """The rollout temperature the model's logits are divided by (the top-k term undoes it: the teacher's
    logprobs are untempered)."""
    sampling_mask: SamplingMask | None = None
    """The engines' top-k / top-p mask the trainer applies to its logits before every logprob (current,
    proximal, reference), so the policy is the truncated distribution the engines sample from; None: the plain
    tempered softmax."""

    @property
    def uses_proximal(self) -> bool:
        """Whether the objective needs proximal logprobs (every loss but `ppo`)."""
        return self.kind != "ppo"

    @property
    def kept_mask_matters(self) -> bool:
        """Whether the policy term's denominator depends on the proximal logprobs (it aggregates over the kept
        mask of a correction that can drop tokens)."""
        drops = self.correction.endswith("mis") or self.veto_max is not None or self.veto_min is not None
        return self.uses_proximal and self.is_normalizer == "kept" and drops


def correction_of(spec: LossSpec, proximal: Tensor | None, behaviour: Tensor, mask: Tensor) -> ImportanceWeights:
    """The behaviour correction of the batch (`none` for `ppo`, which anchors on the behaviour policy)."""
    if not spec.uses_proximal:
        return importance_weights(behaviour, behaviour, mask, "none")
    if proximal is None:
        raise ValueError(f"{spec.kind} needs proximal_logprobs")
    return importance_weights(
        proximal, behaviour, mask, spec.correction, spec.is_cap, spec.is_cap_low, spec.veto_max, spec.veto_min
    )


def policy_mask(spec: LossSpec, iw: ImportanceWeights, mask: Tensor) -> Tensor:
    """The mask the policy term is aggregated over (`is_normalizer`)."""
    return iw.mask if spec.is_normalizer == "kept" else as_bool_mask(mask)


def denominators(spec: LossSpec, proximal: Tensor | None, behaviour: Tensor, mask: Tensor) -> Tensor:
    """`[policy, input]` denominator contributions (float64) of this share; summed over shares they are the
    whole batch's `normalizer` and `input_normalizer`."""
    policy = as_bool_mask(mask)
    if spec.kept_mask_matters:
        policy = correction_of(spec, proximal, behaviour, mask).mask
    return torch.stack(
        [loss_denominator(policy, spec.agg, spec.norm_tokens), loss_denominator(mask, spec.agg, spec.norm_tokens)]
    )


def _surrogate(spec: LossSpec, logprobs: Tensor, anchor: Tensor, advantages: Tensor, mask: Tensor):
    if spec.kind in ("ppo", "decoupled_ppo"):
        return ppo_token_loss(logprobs, anchor, advantages, mask, spec.clip_low, spec.clip_high, spec.dual_clip)
    if spec.kind == "gspo":
        return gspo_token_loss(
            logprobs, anchor, advantages, mask, spec.gspo_clip_low, spec.gspo_clip_high, spec.dual_clip
        )
    if spec.kind == "cispo":
        return cispo_token_loss(logprobs, anchor, advantages, mask, spec.clip_low, spec.clip_high)
    raise ValueError(f"policy loss {spec.kind!r}: allowed {POLICY_LOSSES}")


def policy_loss(
    spec: LossSpec,
    logprobs: Tensor,
    proximal_logprobs: Tensor | None,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    normalizer: float | Tensor | None = None,
    input_normalizer: float | Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The objective of `spec` (module docstring) and its stats (detached 0-d tensors).

    `ppo` anchors on the behaviour logprobs (`proximal_logprobs` and the correction are unused); the other losses
    need `proximal_logprobs`. `ref_logprobs` is required when `kl_coef > 0`; `entropy` (`[batch, seq]`, per-token
    entropy of the current policy, with gradient when `entropy_coef > 0`) adds the bonus and the
    `policy/entropy` stat. Stats: `ppo/*` (over the kept mask), `is/*`, `kl/*`, `loss/policy`, `loss/total`.
    """
    m = as_bool_mask(mask)
    iw = correction_of(spec, proximal_logprobs, behaviour_logprobs, m)
    anchor = proximal_logprobs if spec.uses_proximal else behaviour_logprobs
    token_loss, ratio, flags = _surrogate(spec, logprobs, anchor, advantages, m)
    weighted = masked_fill_zero(iw.weights.to(token_loss.dtype) * token_loss, iw.mask)
    loss = aggregate_loss(weighted, policy_mask(spec, iw, m), spec.agg, normalizer, spec.norm_tokens)
    stats = {**clip_stats(ratio, flags, iw.mask), **iw.stats, "loss/policy": loss.detach()}
    if spec.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"kl_coef={spec.kl_coef} needs ref_logprobs")
        term, kl_stats = kl_penalty(
            logprobs, ref_logprobs, m, spec.kl_coef, spec.kl_kind, spec.agg, input_normalizer, spec.norm_tokens
        )
        loss = loss + term
        stats.update(kl_stats)
    if entropy is not None:
        ent = masked_fill_zero(as_float(entropy), m)
        stats["policy/entropy"] = masked_mean(ent.detach(), m)
        if spec.entropy_coef > 0:
            bonus = spec.entropy_coef * aggregate_loss(ent, m, spec.agg, input_normalizer, spec.norm_tokens)
            loss = loss - bonus
            stats["loss/entropy_bonus"] = bonus.detach()
    stats["loss/total"] = loss.detach()
    return loss, stats
