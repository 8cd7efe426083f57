"""The Megatron trainer's sections: parallel layout, optimizer, trainer processes, checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, model_validator

from megatron_rl.config.base import Section

DEFAULT_STALL_TIMEOUT_S = 3600.0
"""`trainer.stall_timeout_s` when the config leaves it empty (unless the other timeouts need longer)."""
COLLECTIVE_TIMEOUT_MARGIN_S = 120.0
"""Added to trainer.timeout_s for the trainer's process groups. The other ranks wait for rank 0's batch in a
broadcast while rank 0 waits up to trainer.timeout_s for the buffer (after its own per-step work), so rank 0's
deadline, and its error that says why, must come before the broadcast's."""


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
    """Sequences per micro-batch (when `micro_batch_tokens` is 0)."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Tokens per micro-batch: padded micro-batches get as many sequences as fit (the largest divisor of the
    mini-batch share), packed ones as many rows of packed sequences as fit; 0 uses `micro_batch_size` sequences
    (packed: `micro_batch_size` x the padded sequence length)."""
    pack_sequences: bool = False
    """Pack whole sequences end to end into rows of the batch's padded length (attention stays within each; no
    padding between them) in the training and logprob passes, instead of right-padding every one to the longest;
    `micro_batch_tokens` (else `micro_batch_size` x that length) sets the rows per micro-batch."""
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

    stall_timeout_s: float | None = Field(None, gt=0)
    """How long trainer rank 0 may stay at one thing (start-up with the checkpoint's load, a train step, a save, an
    export, a weight push with its recovery) before the launcher ends the run as stuck; its heartbeat shows it alive
    meanwhile, so a long phase is no silence. Empty: 3600 s, or twice the longest wait the other timeouts allow
    one phase if that is longer; a set value must exceed that wait by 60 s."""

    @property
    def collective_timeout_s(self) -> float:
        """The timeout of the trainer's collectives: `timeout_s` plus `COLLECTIVE_TIMEOUT_MARGIN_S`."""
        return self.timeout_s + COLLECTIVE_TIMEOUT_MARGIN_S

    cpu_affinity: list[NonNegativeInt] = Field(default_factory=list)
    """CPU cores the trainer processes run on (empty: all); benchmarks pin trainer and engines apart."""
    cpu_batch_scheduling: bool = True
    """On a CPU host, run the trainer's ranks under Linux's SCHED_BATCH policy: their threads' wake-ups (gloo's
    transfer and work threads, a collective's other side) do not preempt the other rank's or the engines' compute;
    the engines' wake-ups are `rollout.cpu_batch_scheduling`'s (`parallel/scheduling.py`). Ranks on GPUs keep the
    default policy."""


class CheckpointConfig(Section):
    """Where whole-run checkpoints go and how often."""

    save_dir: str = ""
    """Folder for distributed checkpoints (empty: no saving)."""
    save_interval: int = Field(0, ge=0)
    """Save a whole-run checkpoint (trainer, optimizer, RNG, buffer, data position) every this many steps, and
    after the last one (0: only after the last one)."""
    keep_last: int = Field(3, ge=0)
    """Whole-run checkpoints kept in `save_dir`: after each save, all but the newest this many are removed (the one
    `latest` names never is); 0 keeps every one."""
    resume: bool = False
    """Continue from the latest whole-run checkpoint under `save_dir` (`megatron-rl train --resume`); starts from
    scratch when there is none yet."""
    resume_step: int = Field(0, ge=0)
    """With `resume`: continue from the checkpoint of this step (`save_dir/step_<N>`) instead of the latest one,
    e.g. when the latest fails its checksums (0: the latest). Once loaded it becomes `latest` and the later step
    folders move to `save_dir/abandoned/`; a requeued Slurm job rewinds only once (docs/launch.md)."""
    export_final: bool = True
    """At the end of the run, write the policy as a Hugging Face checkpoint folder `RUN_DIR/hf/` (safetensors in
    the dtypes of `model.hf_path`, its config and tokenizer), which transformers and vLLM load."""
    export_hf: bool = False
    """With every whole-run checkpoint, also write the policy as a Hugging Face folder `huggingface/` inside it
    (removed with the checkpoint by `keep_last`)."""

    @model_validator(mode="after")
    def _resume_step_needs_resume(self) -> CheckpointConfig:
        if self.resume_step and not (self.resume and self.save_dir):
            raise ValueError(
                f"checkpoint.resume_step={self.resume_step} picks a checkpoint to resume from: it needs"
                " checkpoint.resume (megatron-rl train --resume) and checkpoint.save_dir"
            )
        return self
