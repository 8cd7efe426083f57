"""The typed schema of a megatron-rl run. Import-light: pydantic only (no torch, Megatron or vLLM).

Every field carries a docstring; `megatron-rl config --explain` prints them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    """Which model to train and in what precision."""

    hf_path: str = ""
    """Folder of a Hugging Face checkpoint (config.json + safetensors); its family is recognised from config.json."""
    family: Literal["qwen3_moe", "mixtral", "deepseek_v3", "qwen3"] | None = None
    """Force a model family instead of recognising it from config.json."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype of trainer and engines (float32 for exact CPU parity tests)."""
    max_sequence_length: int = Field(4096, ge=16)
    """Longest prompt + response the trainer prepares rotary embeddings for."""


class ParallelConfig(Section):
    """The trainer's parallel layout (Megatron's conventions: EP folds over TP x DP)."""

    tp: int = Field(1, ge=1)
    """Tensor parallel size."""
    pp: int = Field(1, ge=1)
    """Pipeline parallel size."""
    ep: int = Field(1, ge=1)
    """Expert parallel size."""
    etp: int = Field(1, ge=1)
    """Expert tensor parallel size."""
    dp: int | None = Field(None, ge=1)
    """Data parallel size; empty picks the smallest that fits ep x etp."""


class OptimizerConfig(Section):
    """Megatron's optimizer (Adam), learning-rate schedule and gradient clipping."""

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(0.0, ge=0)
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay after warm-up."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    clip_grad: float = Field(1.0, ge=0)
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (Megatron's DistributedOptimizer)."""


class TrainerConfig(Section):
    """The Megatron-Core trainer processes."""

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel layout of the trainer."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    micro_batch_size: int = Field(1, ge=1)
    """Sequences per micro-batch."""
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron MoE token dispatcher."""
    moe_aux_loss_coeff: float | None = Field(None, ge=0)
    """Load-balancing loss coefficient; empty keeps the checkpoint's own."""
    recompute: bool = False
    """Recompute activations in the backward pass."""
    seed: int = 1234
    """Seed of parameter init and dropout streams."""
    timeout_s: float = Field(600.0, gt=0)
    """Timeout of every trainer collective; a dead rank ends the job after this long."""
    cpu_affinity: list[int] = Field(default_factory=list)
    """CPU cores the trainer processes run on (empty: all); benchmarks pin trainer and engines apart."""


class CheckpointConfig(Section):
    """Where whole-run checkpoints go and how often."""

    save_dir: str = ""
    """Folder for distributed checkpoints (empty: no saving)."""
    load_dir: str = ""
    """Distributed checkpoint to start from instead of the HF weights (empty: HF weights)."""
    save_interval: int = Field(0, ge=0)
    """Save every this many steps (0: only at the end)."""


class RolloutConfig(Section):
    """The vLLM engines that generate rollouts."""

    num_engines: int = Field(1, ge=1)
    """Number of engine actors."""
    engine_tp: int = Field(1, ge=1)
    """Tensor parallel size of each engine."""
    engine_dp: int = Field(1, ge=1)
    """Data parallel size inside each engine."""
    engine_ep: bool = False
    """Enable vLLM expert parallelism inside each engine (over tp x dp)."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated response."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    samples_per_prompt: int = Field(4, ge=1)
    """Responses per prompt (the group size of group-relative advantages)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_kv_cache_gb: int = Field(1, ge=1)
    """KV cache size of a CPU engine (VLLM_CPU_KVCACHE_SPACE)."""
    max_concurrent_prompts: int = Field(16, ge=1)
    """Prompts in flight per engine."""
    cpu_affinity: list[int] = Field(default_factory=list)
    """CPU cores the engine processes run on (empty: all)."""


class BufferConfig(Section):
    """The rollout buffer between engines and trainer."""

    capacity: int = Field(256, ge=1)
    """Most groups buffered plus in flight (each claimed prompt reserves a slot); generation waits when full."""
    max_staleness: int = Field(4, ge=0)
    """Groups whose oldest token is more than this many versions behind the trainer are dropped (or
    corrected, per `stale_policy`)."""
    max_requeues: int = Field(3, ge=0)
    """How often a prompt whose engine died is generated again before it is dropped."""
    stale_policy: Literal["drop", "correct"] = "drop"
    """What happens to samples beyond `max_staleness`."""


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


class SyncConfig(Section):
    """Weight sync from trainer to engines."""

    transport: Literal["auto", "nccl", "gloo"] = "auto"
    """Broadcast backend: NCCL on GPU, gloo on CPU (auto picks)."""
    bucket_mb: int = Field(256, ge=1)
    """Bucket size in MiB."""
    timeout_s: float = Field(300.0, gt=0)
    """Deadline of one whole sync; an engine that does not join or dies fails it, named."""
    inflight: Literal["pause", "abort"] = "pause"
    """Requests in flight during a sync: paused and resumed, or aborted and continued from their prefix."""


class TaskConfig(Section):
    """Prompts and reward."""

    name: Literal["count", "copy", "jsonl", "parquet"] = "count"
    """Built-in task (`count`, `copy`), or `jsonl`/`parquet` for a dataset file."""
    path: str = ""
    """Dataset file for `jsonl`/`parquet` tasks."""
    reward: str = ""
    """Dotted path of a reward function `fn(response, answer, sample) -> float` (empty: the task's own)."""
    prompt_key: str = "prompt"
    """Dataset column holding the prompt."""
    answer_key: str = "answer"
    """Dataset column holding the reference answer."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this are skipped and counted."""
    seed: int = 0
    """Seed of prompt generation and dataset shuffling."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the dataset (empty: endless)."""
    length: int = Field(8, ge=1)
    """Target response length of the built-in tasks."""


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

    @model_validator(mode="after")
    def _check_batching(self) -> RunConfig:
        if self.buffer.capacity < self.prompts_per_step:
            raise ValueError(
                f"buffer.capacity={self.buffer.capacity} must be at least prompts_per_step={self.prompts_per_step}"
            )
        return self
