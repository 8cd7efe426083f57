"""Pure tensor math for RL post-training: advantages, off-policy corrections, policy losses, KL, metrics.

Layer 4: torch only, no process groups, no Megatron or vLLM. Token tensors are padded `[batch, seq]` with a
`mask` (bool or 0/1; nonzero = a response token that counts); values outside the mask are never read.
"""

from megatron_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    group_index,
    grpo_advantages,
    rloo_advantages,
)
from megatron_rl.algorithms.distill import reverse_kl_rewards, sequence_reverse_kl
from megatron_rl.algorithms.importance import (
    CORRECTIONS,
    ImportanceWeights,
    importance_weights,
    no_correction,
    seq_mis,
    seq_tis,
    sequence_log_ratio,
    token_log_ratio,
    token_mis,
    token_tis,
)
from megatron_rl.algorithms.kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_k2, kl_k3, kl_penalty
from megatron_rl.algorithms.losses import (
    POLICY_LOSSES,
    clipped_surrogate,
    decoupled_ppo_loss,
    policy_loss,
    ppo_clip_loss,
    token_advantages,
)
from megatron_rl.algorithms.masked import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
)
from megatron_rl.algorithms.metrics import effective_sample_size, is_weight_stats, mismatch_metrics

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "ImportanceWeights",
    "aggregate_loss",
    "broadcast_to_tokens",
    "clipped_surrogate",
    "compute_advantages",
    "decoupled_ppo_loss",
    "effective_sample_size",
    "group_index",
    "grpo_advantages",
    "importance_weights",
    "is_weight_stats",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "masked_max",
    "masked_mean",
    "masked_min",
    "masked_sum",
    "mismatch_metrics",
    "no_correction",
    "policy_loss",
    "ppo_clip_loss",
    "reverse_kl_rewards",
    "rloo_advantages",
    "seq_mis",
    "seq_tis",
    "sequence_log_ratio",
    "sequence_reverse_kl",
    "token_advantages",
    "token_log_ratio",
    "token_mis",
    "token_tis",
]
