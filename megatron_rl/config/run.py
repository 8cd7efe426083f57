"""A whole run's config: every section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.base import Section
from megatron_rl.config.cluster import ClusterConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.rollout import BufferConfig, RolloutConfig, SyncConfig
from megatron_rl.config.task import TaskConfig
from megatron_rl.config.trainer import CheckpointConfig, TrainerConfig


class RunConfig(Section):
    """A whole run: model, trainer, engines, buffer, algorithm, sync, task."""

    name: str = "run"
    """Run name (folder under `output_dir`)."""
    output_dir: str = "runs"
    """Where metrics, plots and checkpoints go."""
    mode: Literal["sync", "one_step_off", "async"] = "async"
    """Loop mode: generate-then-train, one step off-policy, or continuous with bounded staleness."""
    steps: int = Field(10, ge=1)
    """Optimizer steps to run."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts (groups) per training step."""
    wandb_project: str = ""
    """Also log metrics to this Weights & Biases project (empty: JSONL and TensorBoard only)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The Megatron trainer."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """The vLLM engines."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """The rollout buffer."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The RL algorithm."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    """Weight sync."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """The task."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """The cluster a production run is planned for."""

    @model_validator(mode="after")
    def _check_batching(self) -> RunConfig:
        if self.buffer.capacity < self.prompts_per_step:
            raise ValueError(
                f"buffer.capacity={self.buffer.capacity} must be at least prompts_per_step={self.prompts_per_step}"
            )
        a = self.algorithm
        if self.buffer.stale_policy == "correct" and (a.loss != "decoupled_ppo" or a.correction == "none"):
            raise ValueError(
                f"buffer.stale_policy=correct keeps groups past max_staleness, which only an importance correction"
                f" makes sound: needs algorithm.loss=decoupled_ppo and a correction (got loss={a.loss},"
                f" correction={a.correction}); or set buffer.stale_policy=drop"
            )
        return self
