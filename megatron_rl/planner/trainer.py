"""Trainer memory per pipeline stage (Megatron-Core, what `trainer/optimizer.py` builds).

Per GPU of each stage:
- parameters: `dtype` bytes each; the GPU holds its stage's layers (plus the embedding on the first stage and the
  output layer on the last), tensor-parallel weights / tp, routed experts / (ep * etp), norms, routers and the MLA
  down projections whole (replicated, as the Transformer Engine spec builds them).
- gradients: 4 bytes per local parameter. DDP keeps one contiguous fp32 gradient buffer (`grad_reduce_in_fp32`,
  as `trainer/optimizer.py` sets it, Megatron's `main_grad`) the size of the local parameters, even with the
  distributed optimizer (which reduce-scatters into it).
- optimizer state: Adam's m and v in fp32 (8 bytes) plus, for bf16 parameters, an fp32 main copy (4 more bytes).
  Megatron's DistributedOptimizer shards them over the data-parallel ranks: dense parameters over dp, expert
  parameters over the expert-data-parallel ranks (edp = tp * dp / (ep * etp)); without it every rank holds all.
  This is Megatron's "6 + 12/d bytes per parameter" (bf16 + fp32 grads + sharded state).
- activations: see `layer_activation_bytes` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", adapted to SwiGLU, GQA/MLA, flash attention and MoE); under 1F1B, stage s holds
  min(pp - s, microbatches) microbatches in flight; with `trainer.recompute` (full, uniform, one layer) only each
  layer's input stays, plus one layer's working set during its recomputation.
- a fixed overhead (CUDA context, NCCL communicators, allocator fragmentation) and the weight-sync double buffer.
- with LoRA (`lora.rank` > 0) the parameters include the adapters and the gradients and optimizer state are the
  adapters' alone (`lora.py`).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.config import RunConfig
from megatron_rl.models import ModelArch, get_family
from megatron_rl.parallel.layout import ParallelLayout, stage_layer_counts
from megatron_rl.planner.common import DTYPE_BYTES, GB
from megatron_rl.planner.lora import optimizer_state_bytes, stage_adapters
from megatron_rl.planner.params import stage_params, topk

TRAINER_OVERHEAD_BYTES = 4 * GB
"""CUDA context (~0.6 GB), NCCL communicators and their buffers, allocator fragmentation, per trainer GPU."""


def layer_activation_bytes(arch: ModelArch, hf_config: dict, layer: int, tokens: int, layout: ParallelLayout,
                           act_bytes: int) -> int:  # fmt: skip
    """Activation bytes one layer keeps for its backward pass, for `tokens` = micro_batch_size * seq_len.

    Korthikanti et al. count 34 * s*b*h bytes (bf16) per GPT layer with a 4h MLP, divided by t under tensor +
    sequence parallelism, plus 5*a*s^2*b for the attention scores, which flash attention does not store. The same
    bookkeeping for these models, in elements of T = s*b tokens (no dropout masks: dropout is off):
    - attention: T times the family's `attention_activation_elements` (GQA: 2h + 2q + 2kv; MLA in
      models/deepseek_v3.py)
    - dense SwiGLU MLP (width f): norm input h, fc1 input h, fc1 output 2f, activation output f -> T(2h + 3f)
    - MoE: norm input and router input 2h, router scores (fp32) 2E, shared expert 3f_s, and per routed token copy
      (T*k of them): permuted input h, fc1 output 2f_e, activation f_e, unpermuted output h -> T(2h + 2E + 3f_s)
      + T*k(2h + 3f_e).
    Everything is divided by tp (sequence parallel shards the token dimension; balanced routing gives each
    expert-parallel rank T*k/tp token copies; expert tensor parallel all-gathers tokens over etp ranks and
    splits the widths: T*k/tp * (2h*etp + 3f_e)).
    """
    h, t = arch.hidden_size, layout.tp
    elements = tokens * get_family(arch.family).attention_activation_elements(arch)
    if arch.is_moe_layer(layer):
        k = topk(hf_config)
        elements += tokens * (2 * h + 2 * arch.num_experts + 3 * arch.shared_expert_ffn_hidden_size)
        elements += tokens * k * (2 * h * layout.etp + 3 * arch.moe_ffn_hidden_size)
    else:
        elements += tokens * (2 * h + 3 * arch.ffn_hidden_size)
    return math.ceil(elements / t) * act_bytes


def logits_bytes(arch: ModelArch, tokens: int, tp: int) -> int:
    """The last stage's vocabulary-parallel logits in fp32 and their log-softmax (two fp32 copies of T * V/tp)."""
    return 2 * 4 * tokens * math.ceil(arch.vocab_size / tp)


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Memory of one trainer GPU in one pipeline stage, in bytes."""

    stage: int
    """Pipeline stage."""
    layers: int
    """Transformer layers on this stage."""
    params: int
    """Parameters on one GPU of this stage."""
    param_bytes: int
    """Parameters in the model dtype."""
    grad_bytes: int
    """fp32 gradient buffer."""
    optimizer_bytes: int
    """Adam state (+ fp32 main params), sharded per the distributed optimizer."""
    activation_bytes: int
    """Activations of the microbatches in flight (1F1B) and the logits on the last stage."""
    overhead_bytes: int
    """CUDA context, NCCL, fragmentation and the weight-sync buffers."""

    @property
    def total_bytes(self) -> int:
        """Everything on this GPU."""
        return sum((self.param_bytes, self.grad_bytes, self.optimizer_bytes, self.activation_bytes,
                    self.overhead_bytes))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrainerPlan:
    """The trainer's layout and its per-GPU memory, stage by stage."""

    layout: str
    """Layout name (`tp4-pp1-ep8-etp1-dp2`)."""
    world_size: int
    """Trainer GPUs."""
    stage_layers: list[int]
    """Transformer layers of each pipeline stage."""
    microbatches: int
    """Microbatches per data-parallel rank per optimizer step."""
    tokens_per_microbatch: int
    """Tokens one microbatch holds: `trainer.micro_batch_tokens`, else micro_batch_size * model.max_sequence_length
    (packed sequences included: the budget is the padded microbatch's)."""
    stages: list[StageMemory]
    """Per-GPU memory of each stage."""
    gpu_memory_bytes: int
    """Memory of one GPU."""

    @property
    def worst(self) -> StageMemory:
        """The stage that needs the most memory."""
        return max(self.stages, key=lambda s: s.total_bytes)


def plan_trainer(cfg: RunConfig, arch: ModelArch, hf_config: dict, layout: ParallelLayout) -> TrainerPlan:
    """Per-GPU memory of every pipeline stage of the trainer."""
    t = cfg.trainer
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    # Adam m and v in fp32, plus an fp32 main copy when the parameters are in a lower precision.
    state_bytes = 8 + (4 if dtype_bytes < 4 else 0)
    dense_shards = layout.data_parallel if t.optimizer.use_distributed_optimizer else 1
    expert_shards = layout.expert_data_parallel if t.optimizer.use_distributed_optimizer else 1
    tokens = t.micro_batch_tokens or t.micro_batch_size * cfg.model.max_sequence_length
    sequences = cfg.prompts_per_step * cfg.rollout.samples_per_prompt
    # At most: packing and short sequences fit more of them into a microbatch than max_sequence_length assumes.
    per_microbatch = max(1, tokens // cfg.model.max_sequence_length)
    microbatches = max(1, math.ceil(sequences / (per_microbatch * layout.data_parallel)))
    counts = stage_layer_counts(layout, arch.num_layers)
    overhead = TRAINER_OVERHEAD_BYTES + 2 * cfg.sync.bucket_mb * 2**20  # double-buffered sync buckets
    stages, start = [], 0
    for stage, count in enumerate(counts):
        layers = range(start, start + count)
        start += count
        p = stage_params(arch, layout, stage, layers)
        dense = math.ceil(p.tp / layout.tp) + p.replicated
        expert = math.ceil(p.expert / (layout.ep * layout.etp))
        local = dense + expert
        optimizer = state_bytes * (math.ceil(dense / dense_shards) + math.ceil(expert / expert_shards))
        trained = local
        if cfg.lora.enabled:  # the base frozen: gradients and optimizer state of the adapters only
            adapters = stage_adapters(cfg.lora, arch, layout, layers)
            local, trained = local + adapters.total, adapters.total
            optimizer = optimizer_state_bytes(cfg, adapters, layout)
        in_flight = min(layout.pp - stage, microbatches)
        per_layer = [layer_activation_bytes(arch, hf_config, i, tokens, layout, dtype_bytes) for i in layers]
        if t.recompute:  # each layer keeps only its input; one layer at a time is recomputed whole
            kept = count * math.ceil(tokens * arch.hidden_size / layout.tp) * dtype_bytes
            activations = in_flight * kept + max(per_layer, default=0)
        else:
            activations = in_flight * sum(per_layer)
        if stage == layout.pp - 1:
            activations += logits_bytes(arch, tokens, layout.tp)
        stages.append(
            StageMemory(
                stage=stage, layers=count, params=local, param_bytes=dtype_bytes * local, grad_bytes=4 * trained,
                optimizer_bytes=optimizer, activation_bytes=activations, overhead_bytes=overhead,
            )
        )  # fmt: skip
    return TrainerPlan(
        layout=layout.describe(), world_size=layout.world_size, stage_layers=counts, microbatches=microbatches,
        tokens_per_microbatch=tokens, stages=stages, gpu_memory_bytes=int(cfg.cluster.memory_gb * GB),
    )  # fmt: skip
