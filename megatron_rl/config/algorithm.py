"""The RL algorithm's section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_rl.config.base import Section


class AlgorithmConfig(Section):
    """Advantages, policy loss and off-policy correction."""

    advantage: Literal["grpo", "grpo_no_std", "rloo"] = "grpo"
    """Group-relative advantage estimator."""
    loss: Literal["ppo", "decoupled_ppo"] = "decoupled_ppo"
    """Policy objective: PPO clip against the behaviour policy, or decoupled (proximal + behaviour)."""
    clip_low: float = Field(0.2, ge=0)
    """Lower PPO clip range (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0)
    """Upper PPO clip range (ratio <= 1 + clip_high)."""
    correction: Literal["none", "tis", "mis", "seq_tis", "seq_mis"] = "tis"
    """Off-policy correction between proximal and behaviour policies."""
    is_cap: float = Field(2.0, gt=0)
    """Truncation (TIS) or masking (MIS) threshold of the importance weight."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the reference policy (0: no reference model)."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """How token losses are averaged."""
