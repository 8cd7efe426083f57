"""The RL algorithm's section: advantages, objective, off-policy correction, KL, entropy, mini-batches, dynamic
sampling and the guards against non-finite numbers (docs/algorithms.md gives every formula and its paper)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Section

PRE_ISSUE_15_FIELDS = frozenset(
    {"advantage", "loss", "clip_low", "clip_high", "correction", "is_cap", "kl_coef", "loss_agg"}
)
"""Every field this section had before `seq_tis`/`seq_mis` changed meaning: a saved config (a complete dump) of
that time holds exactly these."""


class AlgorithmConfig(Section):
    """Advantages, policy loss, off-policy correction, KL and entropy terms, mini-batches and guards."""

    advantage: Literal["grpo", "grpo_no_std", "rloo"] = "grpo"
    """Group-relative advantage estimator: GRPO (mean/std), GRPO without std (Dr. GRPO), or RLOO."""
    loss: Literal["ppo", "decoupled_ppo", "gspo", "cispo"] = "decoupled_ppo"
    """Policy objective: PPO clip against the behaviour policy; decoupled PPO (AReaL: clip against the proximal
    policy, behaviour correction); GSPO (sequence-level ratio and clip); CISPO (clipped detached IS weight)."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip range of the token ratio (ratio >= 1 - clip_low): PPO's clip, CISPO's weight bound."""
    clip_high: float = Field(0.28, ge=0)
    """Upper clip range of the token ratio (ratio <= 1 + clip_high), DAPO's clip-higher by default."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual-clip PPO bound c: where A < 0 a token's loss is at most -c A (ppo, decoupled_ppo, gspo); empty: off."""
    gspo_clip_low: float = Field(3e-4, ge=0)
    """GSPO's lower clip range of the sequence ratio (the paper's 3e-4)."""
    gspo_clip_high: float = Field(4e-4, ge=0)
    """GSPO's upper clip range of the sequence ratio (the paper's 4e-4)."""
    correction: Literal["none", "tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis"] = "tis"
    """Off-policy correction between proximal and behaviour policies: token truncated/masked IS, sequence IS on
    the product of token ratios (seq_*), or on their geometric mean (geo_*)."""
    is_cap: float = Field(2.0, gt=0)
    """Upper bound C of the importance weight: the truncation (TIS) or masking (MIS) threshold."""
    is_cap_low: float | None = Field(None, ge=0)
    """Lower bound of the importance weight (empty: 1/C for the masking corrections, none for the truncating)."""
    is_normalizer: Literal["all", "kept"] = "all"
    """Denominator of the policy loss under a masking correction: every response token (`all`, as AReaL and slime)
    or only the tokens the correction kept (`kept`)."""
    veto_max: float | None = Field(None, gt=0)
    """Mask out every sequence with a token ratio above this (empty: no veto)."""
    veto_min: float | None = Field(None, gt=0)
    """Mask out every sequence with a token ratio below this (verl's catastrophic-token veto; empty: none)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the reference policy (0: no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    """KL estimator: k1, k2, k3 (clamped as verl), or k3+ (k3's value, k2's gradient: that of KL(pi || ref))."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: a loss term, or subtracted from each sequence's reward (sum over its tokens of
    the estimator on behaviour vs reference logprobs) before the advantages."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient (0: the policy's entropy is only a metric)."""
    loss_agg: Literal["token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = "token_mean"
    """How token losses are averaged: over tokens, per sequence then over sequences, summed per sequence then
    averaged over sequences, or summed and divided by a constant (Dr. GRPO)."""
    loss_agg_tokens: int | None = Field(None, ge=1)
    """The constant of `seq_mean_token_sum_norm`: tokens per sequence (empty: `rollout.max_new_tokens`)."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer updates per batch (each on one contiguous slice); the proximal policy is the batch's start, so
    the clip acts from the second on (AReaL uses 4). The new weights go to the engines once per batch."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the batch's mini-batches."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped at the buffer (counted) and
    generation draws more until the batch is full."""
    dynamic_sampling_max_drops: int = Field(64, ge=0)
    """Zero-variance groups dropped at most per batch handed out; past it they are kept (counted), so a policy
    that solves or fails every prompt still trains."""
    max_abs_reward: float = Field(1e6, gt=0)
    """Rewards beyond this magnitude (or not finite) are failures: their group is dropped, counted and logged
    (group statistics lose precision far before float overflow)."""
    sampling_mask: bool = True
    """Apply the engines' top-k / top-p mask (`rollout.top_k`, `rollout.top_p`) to the trainer's logits before
    every logprob, so importance ratios compare the truncated distribution the engines sampled from; off: plain
    tempered logprobs (only to measure the bias). Nothing changes while top-k and top-p are off."""
    routing: Literal["free", "measure", "replay"] = "free"
    """MoE routing between engine and trainer: `free` (each routes by itself), `measure` (the engines return every
    token's experts and the trainer reports `routing/agreement` with its own choices), `replay` (R3: the trainer's
    routers use the engines' experts in the proximal and training forwards; agreement is still reported)."""
    max_skipped_updates_in_a_row: int = Field(5, ge=1)
    """Updates whose loss or gradient norm is not finite are skipped (counted); this many in a row stop the run."""
    forced_lag: int = Field(0, ge=0)
    """Benchmarks only (`bench/staleness.py`, sync mode): the engines always generate with weights exactly this
    many versions old (the trainer pushes version v - k after step v; they keep the start weights before)."""

    @model_validator(mode="before")
    @classmethod
    def _seq_is_changed_meaning(cls, data: Any) -> Any:
        # A complete pre-change dump is recognisable: it names every old field and no new one.
        if (
            isinstance(data, dict)
            and data.get("correction") in ("seq_tis", "seq_mis")
            and set(data) == PRE_ISSUE_15_FIELDS
        ):
            old = data["correction"]
            raise ValueError(
                f"correction={old}: this config was saved before {old} changed meaning. It now means sequence-level"
                f" IS on the product of token ratios exp(sum log r); the former behaviour (the geometric mean of"
                f" token ratios) is geo_{old.split('_')[1]}. Write correction: geo_{old.split('_')[1]} to keep it, or"
                " add any newer algorithm field (e.g. is_normalizer: all) to take the product"
            )
        return data

    @model_validator(mode="after")
    def _on_policy_tokens_kept(self) -> AlgorithmConfig:
        # An on-policy token has ratio 1: bounds that exclude 1 would mask or veto every token of every batch.
        masks = self.correction.endswith("mis")
        low = self.is_cap_low if self.is_cap_low is not None else (1.0 / self.is_cap if masks else 0.0)
        if self.is_cap_low is not None and self.is_cap_low > self.is_cap:
            raise ValueError(f"is_cap_low={self.is_cap_low} must be at most is_cap={self.is_cap}")
        if masks and not low <= 1.0 <= self.is_cap:
            raise ValueError(
                f"correction={self.correction} keeps ratios in [{low:g}, {self.is_cap:g}] (is_cap_low, is_cap), which"
                " leaves out 1: every on-policy token would be masked"
            )
        if self.veto_max is not None and self.veto_max <= 1.0:
            raise ValueError(f"veto_max={self.veto_max} must be above 1: every on-policy sequence would be vetoed")
        if self.veto_min is not None and self.veto_min >= 1.0:
            raise ValueError(f"veto_min={self.veto_min} must be below 1: every on-policy sequence would be vetoed")
        return self
