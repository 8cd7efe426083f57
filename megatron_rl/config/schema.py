"""The typed schema of a megatron-rl run. Import-light: pydantic only (no torch, Megatron or vLLM).

Every field carries a docstring; `megatron-rl config --explain` prints them.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _is_number_type(annotation: Any) -> bool:
    """Whether a field annotation is int or float (also inside `X | None`), but not bool."""
    if annotation in (int, float):
        return True
    return any(arg in (int, float) for arg in get_args(annotation))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML reads yes/no/true/false as booleans and pydantic would take them as 1/0 without a word.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _is_number_type(field.annotation):
            raise ValueError("must be a number, not true/false")
        return value


class ModelConfig(Section):
    """Which model to train and in what precision."""

    hf_path: str = ""
    """Folder of a Hugging Face checkpoint (config.json + safetensors); its family is recognised from config.json."""
    family: Literal["qwen3_moe", "mixtral", "deepseek_v3", "qwen3"] | None = None
    """Force a model family instead of recognising it from config.json."""
    make_tiny: bool = False
    """When hf_path holds no config.json, make a small random checkpoint of `family` there (`megatron-rl
    make-tiny`) instead of failing: for the quickstart, tests and demos, never for a real model."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype of trainer and engines (float32 for exact CPU parity tests)."""
    max_sequence_length: int = Field(4096, ge=16)
    """Longest prompt + response the trainer prepares rotary embeddings for."""
    hf_config: str = ""
    """config.json used for planning (`megatron-rl plan`) when hf_path is not downloaded yet (for example one of
    configs/models/); empty: hf_path/config.json."""

    @model_validator(mode="after")
    def _tiny_needs_family(self) -> ModelConfig:
        if self.make_tiny and not self.family:
            raise ValueError("model.make_tiny=true needs model.family (which family of tiny model to make)")
        return self


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
    first_stage_layers: int | None = Field(None, ge=1)
    """Transformer layers on the first pipeline stage (Megatron's num_layers_in_first_pipeline_stage), for models
    whose layer count no even pp split divides (DeepSeek-V3: 61); the other stages split the rest evenly. Empty:
    even split."""
    last_stage_layers: int | None = Field(None, ge=1)
    """Transformer layers on the last pipeline stage (Megatron's num_layers_in_last_pipeline_stage); a smaller last
    stage leaves room for the output layer and loss. Empty: even split."""


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
    """How long rank 0 waits for a batch; the trainer's collectives wait 120 s longer (so rank 0's error, which says
    why, comes first); a dead rank ends the job after that long."""
    cpu_affinity: list[int] = Field(default_factory=list)
    """CPU cores the trainer processes run on (empty: all); benchmarks pin trainer and engines apart."""


class CheckpointConfig(Section):
    """Where whole-run checkpoints go and how often."""

    save_dir: str = ""
    """Folder for distributed checkpoints (empty: no saving)."""
    save_interval: int = Field(0, ge=0)
    """Save a whole-run checkpoint (trainer, optimizer, RNG, buffer, data position) every this many steps, and
    after the last one (0: only after the last one)."""
    resume: bool = False
    """Continue from the latest whole-run checkpoint under `save_dir` (`megatron-rl train --resume`); starts from
    scratch when there is none yet."""


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
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer computes its logprobs at the same temperature (logits / temperature), so
    the importance ratios between trainer and engines compare the same distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold; must stay 1 for training (the engines' logprobs would be renormalised over the
    nucleus, which the trainer does not reproduce, biasing every importance ratio downwards)."""
    samples_per_prompt: int = Field(4, ge=1)
    """Responses per prompt (the group size of group-relative advantages)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_kv_cache_gb: int = Field(1, ge=1)
    """KV cache size of a CPU engine (VLLM_CPU_KVCACHE_SPACE)."""
    max_concurrent_prompts: int = Field(16, ge=1)
    """Prompts in flight per engine."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest one prompt's responses (all its samples) may take on an engine; past it they count as an engine
    failure and the prompt is requeued."""
    cpu_affinity: list[int] = Field(default_factory=list)
    """CPU cores the engine processes run on (empty: all)."""
    max_engine_restarts: int = Field(3, ge=0)
    """How often each engine that dies is restarted (and brought to the current weights) before the run fails."""

    @field_validator("top_p")
    @classmethod
    def _full_nucleus(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError(
                "must be 1: the engines' logprobs would be renormalised over the nucleus, which the trainer does not"
                " reproduce, so every importance ratio would be biased"
            )
        return value


class BufferConfig(Section):
    """The rollout buffer between engines and trainer."""

    capacity: int = Field(256, ge=1)
    """Most groups buffered plus in flight (each claimed prompt reserves a slot); generation waits when full."""
    max_staleness: int = Field(4, ge=0)
    """Groups whose oldest token is more than this many versions behind the trainer are dropped (or kept, per
    `stale_policy`)."""
    max_requeues: int = Field(3, ge=0)
    """How often a prompt whose engine died is generated again before it is dropped."""
    stale_policy: Literal["drop", "correct"] = "drop"
    """What happens to groups beyond `max_staleness`: `drop` them, or `correct`: keep them (counted as stale in
    the metrics) and rely on the token-level importance correction every group gets (`algorithm.correction` with
    the decoupled loss), which a run with this policy must therefore have; no extra correction is applied."""


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
    bucket_mb: int = Field(64, ge=1)
    """Bucket size in MiB: the trainer holds 2 and each engine worker 3. 64 (the quickstart's, `verify sync`'s
    and `bench/weight_sync.py`'s) is what CPU runs were measured at; the GPU configs set 512-1024."""
    timeout_s: float = Field(300.0, gt=0)
    """Deadline of one whole sync; an engine that does not join or dies fails it, named."""
    gloo_streams: int = Field(2, ge=1, le=8)
    """gloo (CPU) only: TCP connections between the sender and each engine worker, taken in turn by
    consecutive broadcasts so that several move at once (one loopback stream is latency-bound: two moved the
    same bytes in about 0.7 of the time). NCCL ignores it."""
    inflight: Literal["pause", "abort"] = "pause"
    """Requests in flight during a sync: paused and resumed, or aborted and continued from their prefix."""
    bind_host: str = "127.0.0.1"
    """Address each sender's rendezvous store binds to and engines connect to: loopback by default; on several
    nodes this node's address, or `auto` (MRL_NODE_IP, else the address of this host's name)."""


class TaskConfig(Section):
    """Prompts and reward."""

    name: Literal["count", "copy", "jsonl", "parquet"] = "count"
    """Built-in task (`count`, `copy`), or `jsonl`/`parquet` for a dataset file."""
    path: str = ""
    """Dataset file for `jsonl`/`parquet` tasks."""
    reward: str = ""
    """Dotted path of a reward function `fn(response, answer, sample) -> float` (empty: the task's own)."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Longest one reward call may take; past it the sample's reward is NaN (a failed reward, counted and logged)
    and the call's thread is left to finish (Python cannot stop it)."""
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
    max_bad_reward_groups_in_a_row: int = Field(32, ge=1)
    """Groups dropped in a row because a reward raised or was not a finite number before the run stops (a reward
    function that always fails is a bug, not noise); single failures are counted and the run goes on."""


GPU_MEMORY_GB = {"h100": 80.0, "h200": 141.0}
"""Memory of each GPU type the planner knows (SXM parts), in GB as the vendors state it (10^9 bytes)."""


class ClusterConfig(Section):
    """The machines a production run is planned for (`megatron-rl plan`); local runs ignore it."""

    gpu: Literal["h100", "h200"] = "h100"
    """GPU type of every node."""
    gpu_memory_gb: float | None = Field(None, gt=0)
    """Memory of one GPU in GB (10^9 bytes); empty: the type's own (h100 80, h200 141)."""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs per node."""
    trainer_nodes: int | None = Field(None, ge=1)
    """Nodes of the Megatron trainer: its world size must be trainer_nodes x gpus_per_node. Empty: trainer and
    engines share one node (a local run)."""
    inference_nodes: int | None = Field(None, ge=1)
    """Nodes of the vLLM engines: num_engines x engine_tp x engine_dp must be inference_nodes x gpus_per_node.
    Empty: trainer and engines share one node (a local run)."""

    @property
    def memory_gb(self) -> float:
        """Memory of one GPU in GB: the configured value or the GPU type's."""
        return self.gpu_memory_gb if self.gpu_memory_gb is not None else GPU_MEMORY_GB[self.gpu]


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
