"""Engine memory and layout checks (vLLM), per GPU.

- weights: `dtype` bytes each; attention, dense MLPs and vocabulary / engine_tp; routed experts / (engine_tp *
  engine_dp) with `engine_ep`, else / engine_tp (vLLM splits each expert's width); norms, routers and MLA down
  projections whole.
- weight sync: every engine GPU receives each non-expert tensor whole (vLLM cuts its own shard), and under
  `engine_ep` only the experts it hosts (1 / (engine_tp * engine_dp) of them, `weights/owners.py`), else all.
- KV cache room = gpu_memory_utilization * GPU memory - weights - overhead (CUDA graphs, activation peak, NCCL)
  - the weight-sync receive buffers; the tokens it holds: the family's `kv_cache_elements` per token per layer
  (MLA: kv_lora_rank + qk_rope_head_dim, the latent is the same on every TP rank; GQA: 2 * max(1, kv_heads /
  engine_tp) * head_dim).
- teacher engines (on-policy distillation, `distill`): the same arithmetic at `distill.engine_tp` on the
  teacher's shape (a snapshot teacher: the policy's), without expert parallelism; a fixed teacher receives no
  weight sync, so it needs no receive buffers.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.config import RunConfig
from megatron_rl.models import ModelArch, get_family
from megatron_rl.planner.common import DTYPE_BYTES, GB, PlanError
from megatron_rl.planner.params import embedding_params, head_params, layer_params, sum_params

ENGINE_OVERHEAD_BYTES = 4 * GB
"""vLLM's non-KV working memory inside its budget: activation peak of a prefill batch, CUDA graphs, NCCL."""


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """The engines' layout and per-GPU memory."""

    num_engines: int
    """Engine actors."""
    gpus_per_engine: int
    """engine_tp * engine_dp."""
    weight_bytes: int
    """Weights on one engine GPU."""
    overhead_bytes: int
    """vLLM working memory plus the weight-sync receive buffers."""
    budget_bytes: int
    """gpu_memory_utilization * GPU memory."""
    kv_cache_bytes: int
    """What is left for the KV cache."""
    kv_bytes_per_token: int
    """KV cache bytes one token takes on one GPU (all layers)."""
    kv_cache_tokens: int
    """Tokens one data-parallel replica of an engine can hold."""
    max_sequences: int
    """Sequences of model.max_sequence_length one replica can hold at once."""
    gpu_memory_bytes: int
    """Memory of one GPU."""
    sync_bytes_per_gpu: int = 0
    """Bytes one engine GPU receives per weight sync (each expert only where it is hosted under engine_ep)."""
    sync_bytes_per_gpu_broadcast: int = 0
    """The same if every tensor were broadcast to every engine GPU (what engines without engine_ep receive)."""


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """How a pool of engines serves a model: what the memory plan depends on."""

    what: str
    """The config section that sets it, for errors: `rollout` or `distill`."""
    num_engines: int
    tp: int
    dp: int
    ep: bool
    dtype: str
    synced: bool
    """Whether the pool receives weight syncs (and so holds the receive buffers)."""

    @classmethod
    def students(cls, cfg: RunConfig) -> EngineShape:
        """The policy's engines (`rollout`)."""
        r = cfg.rollout
        return cls("rollout", r.num_engines, r.engine_tp, r.engine_dp, r.engine_ep, cfg.model.dtype, True)

    @classmethod
    def teachers(cls, cfg: RunConfig) -> EngineShape:
        """The teacher's engines (`distill`): one replica each, synced only as a snapshot."""
        d = cfg.distill
        dtype = d.teacher_dtype or cfg.model.dtype
        return cls("distill", d.num_engines, d.engine_tp, 1, False, dtype, d.teacher == "snapshot")


def check_engine_layout(cfg: RunConfig, arch: ModelArch, shape: EngineShape | None = None) -> None:
    """PlanError when vLLM cannot shard the model at the pool's engine_tp / engine_dp / engine_ep (default: the
    policy's engines)."""
    e = shape or EngineShape.students(cfg)
    if arch.num_heads % e.tp:
        raise PlanError(f"{e.what}.engine_tp={e.tp}: the model's attention heads ({arch.num_heads}) are not"
                        f" divisible by {e.tp}")  # fmt: skip
    if not get_family(arch.family).kv_heads_fit(arch, e.tp):
        raise PlanError(f"{e.what}.engine_tp={e.tp}: neither divides nor is a multiple of the model's key/value"
                        f" heads ({arch.num_kv_heads})")  # fmt: skip
    if not arch.num_experts:
        return
    if e.ep and arch.num_experts % (e.tp * e.dp):
        raise PlanError(
            f"{e.what}.engine_ep=true: the model's experts ({arch.num_experts}) are not divisible by engine_tp *"
            f" engine_dp = {e.tp * e.dp}"
        )
    if not e.ep and arch.moe_ffn_hidden_size % e.tp:
        raise PlanError(f"{e.what}.engine_tp={e.tp}: the expert MLP width ({arch.moe_ffn_hidden_size}) is not"
                        f" divisible by {e.tp}")  # fmt: skip


def kv_bytes_per_token(arch: ModelArch, engine_tp: int, dtype_bytes: int) -> int:
    """KV cache bytes of one token (all layers) on one engine GPU, from the family's values per layer."""
    return get_family(arch.family).kv_cache_elements(arch, engine_tp) * arch.num_layers * dtype_bytes


def plan_engines(cfg: RunConfig, arch: ModelArch, shape: EngineShape | None = None) -> EnginePlan:
    """Per-GPU weights and KV-cache room of a pool of vLLM engines (default: the policy's)."""
    e = shape or EngineShape.students(cfg)
    check_engine_layout(cfg, arch, e)
    dtype_bytes = DTYPE_BYTES[e.dtype]
    whole = (
        embedding_params(arch) + head_params(arch) + sum_params(layer_params(arch, i) for i in range(arch.num_layers))
    )
    expert_split = e.tp * e.dp if e.ep else e.tp
    weights = dtype_bytes * (math.ceil(whole.tp / e.tp) + whole.replicated + math.ceil(whole.expert / expert_split))
    memory = int(cfg.cluster.memory_gb * GB)
    budget = int(cfg.rollout.gpu_memory_utilization * memory)
    # The receiver holds RECEIVE_BUFFERS (3) buckets: one being loaded, two arriving (weights/receiver.py).
    overhead = ENGINE_OVERHEAD_BYTES + (3 * cfg.sync.bucket_mb * 2**20 if e.synced else 0)
    room = budget - weights - overhead
    per_token = kv_bytes_per_token(arch, e.tp, dtype_bytes)
    tokens = max(0, room) // per_token
    everything = dtype_bytes * (whole.tp + whole.replicated + whole.expert)
    received = (
        dtype_bytes * (whole.tp + whole.replicated + math.ceil(whole.expert / expert_split)) if e.ep else everything
    )
    return EnginePlan(
        num_engines=e.num_engines, gpus_per_engine=e.tp * e.dp, weight_bytes=weights,
        overhead_bytes=overhead, budget_bytes=budget, kv_cache_bytes=room, kv_bytes_per_token=per_token,
        kv_cache_tokens=tokens, max_sequences=tokens // cfg.model.max_sequence_length, gpu_memory_bytes=memory,
        sync_bytes_per_gpu=received if e.synced else 0, sync_bytes_per_gpu_broadcast=everything if e.synced else 0,
    )  # fmt: skip
