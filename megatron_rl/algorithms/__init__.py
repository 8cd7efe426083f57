"""Pure tensor math for RL post-training: advantages, off-policy corrections, policy losses, KL, entropy, metrics.

Layer 4: torch only, no process groups, no Megatron or vLLM. Token tensors are padded `[batch, seq]` with a
`mask` (bool or 0/1; nonzero = a response token that counts); values outside the mask are never read.
docs/algorithms.md gives every formula with its paper and config field.
"""

from megatron_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    group_index,
    grpo_advantages,
    rloo_advantages,
)
from megatron_rl.algorithms.distill import distill_advantages, reverse_kl_rewards, reverse_kl_sums, sequence_reverse_kl
from megatron_rl.algorithms.entropy import entropy_from_logits
from megatron_rl.algorithms.importance import (
    CORRECTIONS,
    MAX_LOG_RATIO,
    ImportanceWeights,
    geometric_log_ratio,
    importance_weights,
    sequence_log_ratio,
    token_log_ratio,
    veto_sequences,
)
from megatron_rl.algorithms.kl import (
    KL_ESTIMATORS,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_k2_grad,
    kl_penalty,
    sequence_kl,
)
from megatron_rl.algorithms.losses import (
    POLICY_LOSSES,
    cispo_token_loss,
    clip_stats,
    clip_surrogate,
    gspo_token_loss,
    ppo_token_loss,
    token_advantages,
)
from megatron_rl.algorithms.masked import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    loss_denominator,
    loss_numerator,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
)
from megatron_rl.algorithms.metrics import (
    effective_sample_size,
    fresh_mismatch_metrics,
    is_weight_stats,
    mismatch_metrics,
)
from megatron_rl.algorithms.objective import LossSpec, denominators, policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "MAX_LOG_RATIO",
    "POLICY_LOSSES",
    "ImportanceWeights",
    "LossSpec",
    "aggregate_loss",
    "broadcast_to_tokens",
    "cispo_token_loss",
    "clip_stats",
    "clip_surrogate",
    "compute_advantages",
    "distill_advantages",
    "denominators",
    "effective_sample_size",
    "entropy_from_logits",
    "geometric_log_ratio",
    "group_index",
    "grpo_advantages",
    "gspo_token_loss",
    "importance_weights",
    "is_weight_stats",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_k2_grad",
    "kl_penalty",
    "loss_denominator",
    "loss_numerator",
    "masked_max",
    "masked_mean",
    "masked_min",
    "masked_sum",
    "mismatch_metrics",
    "fresh_mismatch_metrics",
    "policy_loss",
    "ppo_token_loss",
    "reverse_kl_rewards",
    "reverse_kl_sums",
    "rloo_advantages",
    "sequence_kl",
    "sequence_log_ratio",
    "sequence_reverse_kl",
    "token_advantages",
    "token_log_ratio",
    "veto_sequences",
]
