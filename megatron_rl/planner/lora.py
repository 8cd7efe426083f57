"""LoRA in the plan: the adapters' parameters, gradients and optimizer state per trainer GPU, and the bytes an
adapter-only weight sync sends beside a full sync's.

Per GPU (what `trainer/lora.py` builds): a column-parallel layer's A [r, in] is whole and its B [out, r] split over
tp; a row-parallel layer's A is split over tp and its B whole; routed experts have one pair per expert, ep-way
over the experts and split over etp the same way. The base is frozen, so DDP's fp32 gradient buffer and Adam's
state (sharded by the distributed optimizer: dense adapters over dp, expert adapters over the expert-data-parallel
ranks) cover the adapters alone; the base keeps only its parameters.

Sync bytes: the adapters' Hugging Face / peft tensors in the model dtype, each sent once (`iter_adapter_tensors`):
a fused layer's A once per HF module it covers (q, k, v; gate, up), B's rows once. A full sync sends every HF
tensor of the model. Not counted: the adapters' activations (r values per token and target, against the base
layer's h or more).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.config import LoraConfig, RunConfig
from megatron_rl.models import ModelArch, get_family
from megatron_rl.models.lora import AdaptedLinear, adapted_linears
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.planner.common import DTYPE_BYTES


@dataclasses.dataclass(frozen=True)
class LocalAdapters:
    """Adapter parameters on one GPU, split by how the distributed optimizer shards their state."""

    dense: int = 0
    """Attention and dense-MLP adapters (state sharded over dp)."""
    expert: int = 0
    """Routed-expert adapters (state sharded over the expert-data-parallel ranks)."""

    @property
    def total(self) -> int:
        """Both."""
        return self.dense + self.expert


def local_params(linear: AdaptedLinear, rank: int, layout: ParallelLayout) -> int:
    """One GPU's share of an adapted linear's A and B."""
    expert = linear.target.startswith("expert_")
    split = layout.etp if expert else layout.tp
    copies = linear.copies // layout.ep if expert else linear.copies
    a, b = rank * linear.in_features, rank * linear.out_features
    per_copy = a + math.ceil(b / split) if linear.column_parallel else math.ceil(a / split) + b
    return copies * per_copy


def stage_adapters(cfg: LoraConfig, arch: ModelArch, layout: ParallelLayout, layers: range) -> LocalAdapters:
    """Adapter parameters on one GPU of the pipeline stage holding `layers`."""
    dense = expert = 0
    for linear in adapted_linears(get_family(arch.family), arch, cfg.targets, layers):
        count = local_params(linear, cfg.rank, layout)
        if linear.target.startswith("expert_"):
            expert += count
        else:
            dense += count
    return LocalAdapters(dense=dense, expert=expert)


@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """The adapters of a run: their size, per-GPU memory of the worst stage and the sync bytes."""

    rank: int
    """lora.rank."""
    targets: tuple[str, ...]
    """lora.targets."""
    sync: str
    """lora.sync (how the engines apply them)."""
    adapted_layers: dict[str, int]
    """Target -> adapted linears in the model (every expert counted)."""
    params: int
    """Adapter parameters of the whole model (trainer form: one A per fused layer)."""
    stage_params: list[int]
    """Adapter parameters on one GPU of each pipeline stage."""
    param_bytes: list[int]
    """Those in the model dtype, per stage."""
    grad_bytes: list[int]
    """Their fp32 gradient buffer, per stage."""
    optimizer_bytes: list[int]
    """Their Adam state (+ fp32 main copies in bf16), sharded per the distributed optimizer, per stage."""
    sync_bytes: int
    """One adapter-only sync: every HF-named adapter tensor once, in the model dtype."""
    full_sync_bytes: int
    """One full sync: every HF tensor of the model in the model dtype."""

    @property
    def sync_fraction(self) -> float:
        """Adapter-only sync bytes over a full sync's."""
        return self.sync_bytes / self.full_sync_bytes


def optimizer_state_bytes(cfg: RunConfig, local: LocalAdapters, layout: ParallelLayout) -> int:
    """Adam m, v (fp32) and, for low-precision parameters, an fp32 main copy, sharded as the trainer shards them."""
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    state = 8 + (4 if dtype_bytes < 4 else 0)
    distributed = cfg.trainer.optimizer.use_distributed_optimizer
    dense_shards = layout.data_parallel if distributed else 1
    expert_shards = layout.expert_data_parallel if distributed else 1
    return state * (math.ceil(local.dense / dense_shards) + math.ceil(local.expert / expert_shards))


def plan_lora(
    cfg: RunConfig, arch: ModelArch, layout: ParallelLayout, stages: list[range], total_params: int
) -> LoraPlan:
    """The adapters' plan for a run with `lora.rank` > 0; `stages` are the layers of each pipeline stage and
    `total_params` the model's (what a full sync sends)."""
    lora, dtype_bytes = cfg.lora, DTYPE_BYTES[cfg.model.dtype]
    linears = adapted_linears(get_family(arch.family), arch, lora.targets)
    counts: dict[str, int] = {}
    for linear in linears:
        counts[linear.target] = counts.get(linear.target, 0) + linear.copies
    local = [stage_adapters(lora, arch, layout, layers) for layers in stages]
    return LoraPlan(
        rank=lora.rank, targets=tuple(lora.targets), sync=lora.sync, adapted_layers=counts,
        params=sum(linear.params(lora.rank) for linear in linears),
        stage_params=[a.total for a in local], param_bytes=[dtype_bytes * a.total for a in local],
        grad_bytes=[4 * a.total for a in local],
        optimizer_bytes=[optimizer_state_bytes(cfg, a, layout) for a in local],
        sync_bytes=dtype_bytes * sum(linear.hf_params(lora.rank) for linear in linears),
        full_sync_bytes=dtype_bytes * total_params,
    )  # fmt: skip
