"""A whole run's config: every section."""

from __future__ import annotations

import importlib.util
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.base import Section
from megatron_rl.config.cluster import ClusterConfig
from megatron_rl.config.distill import DistillConfig
from megatron_rl.config.eval import EvalConfig
from megatron_rl.config.lora import LoraConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.rollout import BufferConfig, RolloutConfig, SyncConfig
from megatron_rl.config.task import TaskConfig
from megatron_rl.config.trainer import DEFAULT_STALL_TIMEOUT_S, CheckpointConfig, TrainerConfig

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RunConfig(Section):
    """A whole run: model, trainer, engines, buffer, algorithm, sync, task."""

    name: str = "run"
    """Run name: the run's folder under `output_dir`, so a name, not a path (letters, digits, `.`, `_`, `-`)."""
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
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation on validation prompts during training."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """On-policy distillation from a teacher (off by default)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Low-rank adapters on the policy, the base frozen (off by default: `lora.rank` 0)."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """The cluster a production run is planned for."""

    @field_validator("wandb_project")
    @classmethod
    def _wandb_installed(cls, value: str) -> str:
        # Checked here, not when the trainer starts logging minutes later; find_spec does not import it.
        if value and importlib.util.find_spec("wandb") is None:
            raise ValueError("needs the wandb package: pip install -e .[cpu,wandb] (or leave wandb_project empty)")
        return value

    @field_validator("name")
    @classmethod
    def _a_name_not_a_path(cls, value: str) -> str:
        if not _RUN_NAME.fullmatch(value) or value in (".", ".."):
            raise ValueError(
                "must be a folder name (letters, digits, '.', '_', '-'; no '/' and not '..'): the run folder is"
                " output_dir/name"
            )
        return value

    @model_validator(mode="after")
    def _check_batching(self) -> RunConfig:
        if self.buffer.capacity < self.prompts_per_step:
            raise ValueError(
                f"buffer.capacity={self.buffer.capacity} must be at least prompts_per_step={self.prompts_per_step}"
            )
        if self.mode != "sync" and self.buffer.max_staleness < 1:
            raise ValueError(
                f"mode={self.mode} generates at least one step ahead of the trainer, which buffer.max_staleness=0"
                " forbids (every group generated ahead would be dropped as stale): set mode=sync, or"
                " buffer.max_staleness >= 1"
            )
        a = self.algorithm
        if self.buffer.stale_policy == "correct" and (a.loss == "ppo" or a.correction == "none"):
            raise ValueError(
                f"buffer.stale_policy=correct keeps groups past max_staleness, which only an importance correction"
                f" makes sound: needs a decoupled algorithm.loss (decoupled_ppo, gspo, cispo) and a correction (got"
                f" loss={a.loss}, correction={a.correction}); or set buffer.stale_policy=drop"
            )
        samples = self.prompts_per_step * self.rollout.samples_per_prompt
        if samples % a.ppo_minibatches:
            raise ValueError(
                f"algorithm.ppo_minibatches={a.ppo_minibatches} must divide the batch of prompts_per_step x"
                f" rollout.samples_per_prompt = {samples} sequences"
            )
        return self

    @model_validator(mode="after")
    def _check_lengths(self) -> RunConfig:
        """A prompt and its response must fit the engines' and the trainer's sequence length."""
        seq, new = self.model.max_sequence_length, self.rollout.max_new_tokens
        if new >= seq:
            raise ValueError(
                f"rollout.max_new_tokens={new} leaves no room for a prompt in model.max_sequence_length={seq}"
            )
        task = self.task
        if task.name in ("jsonl", "parquet", "dataset"):
            if "max_prompt_tokens" not in task.model_fields_set:
                task.max_prompt_tokens = seq - new  # the default: whatever fits (longer rows are skipped, counted)
            elif task.max_prompt_tokens + new > seq:
                raise ValueError(
                    f"task.max_prompt_tokens={task.max_prompt_tokens} + rollout.max_new_tokens={new} exceeds"
                    f" model.max_sequence_length={seq}: a long prompt and its response would not fit"
                )
        return self

    @model_validator(mode="after")
    def _check_algorithm_needs(self) -> RunConfig:
        a = self.algorithm
        if a.dynamic_sampling and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "algorithm.dynamic_sampling drops groups whose rewards are all equal, which every group of one sample"
                f" is: needs rollout.samples_per_prompt >= 2 (got {self.rollout.samples_per_prompt})"
            )
        if a.forced_lag and (self.mode != "sync" or self.buffer.max_staleness < a.forced_lag):
            raise ValueError(
                f"algorithm.forced_lag={a.forced_lag} makes every sample exactly that many versions old: needs mode=sync"
                f" (got {self.mode}) and buffer.max_staleness >= {a.forced_lag} (got {self.buffer.max_staleness})"
            )
        if a.kl_in == "reward" and a.kl_coef == 0:
            raise ValueError("algorithm.kl_in=reward needs algorithm.kl_coef > 0 (the coefficient of the penalty)")
        r = self.rollout
        if a.sampling_mask and r.top_p < 1 and r.top_k < 1:
            raise ValueError(
                f"rollout.top_p={r.top_p:g} with algorithm.sampling_mask needs rollout.top_k (e.g. 64): the engines"
                " return each token's kept set, which only top-k bounds (they ask vLLM for top_k + 1 logprobs);"
                " or set algorithm.sampling_mask=false (the importance ratios are then biased)"
            )
        return self

    @property
    def phase_wait_s(self) -> float:
        """The longest the other timeouts let one phase of trainer rank 0 wait (the trainer starts a new phase
        at each of these waits): a collective or a batch, an engine's restart, forming the weight groups and
        pushing (the engines' start, connect and join, then a push and its reports: 4 x sync.timeout_s + 30),
        the last step's evaluation."""
        r = self.rollout
        restart, engines = r.hang_timeout_s + r.restart_timeout_s, 4 * self.sync.timeout_s + 30
        evaluation = self.eval.timeout_s if self.eval.interval > 0 else 0.0
        return max(self.trainer.collective_timeout_s, restart, engines, evaluation)

    @property
    def stall_timeout_s(self) -> float:
        """`trainer.stall_timeout_s`, or its default: the launcher's bound on one phase of trainer rank 0."""
        if self.trainer.stall_timeout_s is not None:
            return self.trainer.stall_timeout_s
        return max(DEFAULT_STALL_TIMEOUT_S, 2 * self.phase_wait_s)

    @model_validator(mode="after")
    def _check_stall_bound(self) -> RunConfig:
        stall, wait = self.trainer.stall_timeout_s, self.phase_wait_s
        if stall is not None and stall < wait + 60:
            raise ValueError(
                f"trainer.stall_timeout_s={stall:g} must exceed by 60 s the {wait:g} s that the other timeouts let"
                " one trainer phase wait (the longest of trainer.timeout_s + 120, rollout.hang_timeout_s +"
                " rollout.restart_timeout_s, 4 x sync.timeout_s + 30 and eval.timeout_s): the launcher would end a"
                " run that is only waiting"
            )
        return self

    @property
    def returns_kept_sets(self) -> bool:
        """Whether the engines return each response token's kept set (`algorithm.sampling_mask` with top-k on):
        the trainer then masks its logits to those sets."""
        return self.algorithm.sampling_mask and self.rollout.top_k > 0

    @model_validator(mode="after")
    def _check_distillation(self) -> RunConfig:
        """Pure distillation (`distill.use_reward=false`) leaves no room for what acts on the reward."""
        d, a = self.distill, self.algorithm
        if not d.enabled or d.use_reward:
            return self
        if a.dynamic_sampling:
            raise ValueError(
                "algorithm.dynamic_sampling drops groups whose rewards are all equal, but distill.use_reward=false"
                " trains on the teacher's score only: switch one of them off"
            )
        if a.kl_in == "reward" and a.kl_coef > 0:
            raise ValueError(
                "algorithm.kl_in=reward puts the reference KL into the reward, which distill.use_reward=false"
                " does not train on: set algorithm.kl_in=loss (or distill.use_reward=true)"
            )
        return self
