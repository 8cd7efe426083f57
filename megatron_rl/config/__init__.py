"""Typed configuration: one module per component's sections, YAML loading, dotted overrides.

Imports no torch, Megatron or vLLM (pydantic and PyYAML only), so that commands and launch scripts stay fast.
"""

from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.cluster import ClusterConfig
from megatron_rl.config.distill import DistillConfig
from megatron_rl.config.eval import EvalConfig
from megatron_rl.config.loader import ConfigError, dump_config, explain, load_config, parse_override
from megatron_rl.config.lora import LoraConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.rollout import BufferConfig, RolloutConfig, SyncConfig
from megatron_rl.config.run import RunConfig
from megatron_rl.config.task import TaskConfig
from megatron_rl.config.trainer import CheckpointConfig, OptimizerConfig, ParallelConfig, TrainerConfig

__all__ = [
    "AlgorithmConfig", "BufferConfig", "CheckpointConfig", "ClusterConfig", "ConfigError", "DistillConfig", "EvalConfig",
    "LoraConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "RolloutConfig", "RunConfig", "SyncConfig",
    "TaskConfig", "TrainerConfig", "dump_config", "explain", "load_config", "parse_override",
]  # fmt: skip
