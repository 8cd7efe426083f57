"""`megatron-rl plan`: will a run config fit its cluster? Per-GPU memory of the trainer and of the engines.

Pure Python at the config layer (no torch, Megatron or vLLM): it reads the model's shape from its Hugging Face
`config.json` (`model.hf_config`, else `model.hf_path/config.json`, else with `model.make_tiny` the tiny model
that `make-tiny` would create for `model.family`) and the layouts from the run config, and estimates, per GPU:

Trainer (Megatron-Core, what `trainer/optimizer.py` builds), for the worst pipeline stage:
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

Engines (vLLM), per GPU:
- weights: `dtype` bytes each; attention, dense MLPs and vocabulary / engine_tp; routed experts / (engine_tp *
  engine_dp) with `engine_ep`, else / engine_tp (vLLM splits each expert's width); norms, routers and MLA down
  projections whole.
- KV cache room = gpu_memory_utilization * GPU memory - weights - overhead (CUDA graphs, activation peak, NCCL)
  - the weight-sync receive buffers; the tokens it holds: MLA stores kv_lora_rank + qk_rope_head_dim values per
  token per layer (the latent is the same on every TP rank); GQA stores 2 * max(1, kv_heads / engine_tp) *
  head_dim per token per layer.

Not modelled: DeepSeek-V3's multi-token-prediction layer (about 14B parameters in the published checkpoint; not
trained here, `num_nextn_predict_layers` is ignored), Megatron's vocabulary padding, context parallelism, optimizer
CPU offload, FP8. GPU memory is taken in decimal GB (10^9 bytes), which is a little conservative (an "80 GB" H100
has 85.5e9 bytes usable).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.errors import UserError
from megatron_rl.models import CheckpointError, ModelArch, family_for_hf_config, get_family
from megatron_rl.parallel.layout import (
    LayoutError,
    ParallelLayout,
    check_layout_fits_model,
    layout_from_config,
    stage_layer_counts,
)

GB = 10**9
"""Bytes in a (decimal) gigabyte, as GPU vendors count."""
TRAINER_OVERHEAD_BYTES = 4 * GB
"""CUDA context (~0.6 GB), NCCL communicators and their buffers, allocator fragmentation, per trainer GPU."""
ENGINE_OVERHEAD_BYTES = 4 * GB
"""vLLM's non-KV working memory inside its budget: activation peak of a prefill batch, CUDA graphs, NCCL."""
TINY_VOCAB = 512
"""Vocabulary of the tiny model `make-tiny` writes (tools/make_tiny.py TINY_VOCAB; a test keeps them equal)."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_REPO_ROOT = Path(__file__).resolve().parents[1]


class PlanError(UserError, ValueError):
    """A run config that does not divide its model or cluster, or does not fit in GPU memory; names the field."""


@dataclasses.dataclass(frozen=True)
class Params:
    """A parameter count split by how the parallel layouts shard it."""

    tp: int = 0
    """Split across tensor-parallel ranks (attention projections, dense and shared-expert MLPs, vocabulary)."""
    replicated: int = 0
    """Held whole by every tensor-parallel rank (norms, routers, MLA down projections)."""
    expert: int = 0
    """Routed-expert weights: split across expert-parallel (and expert-tensor-parallel) ranks."""

    def __add__(self, other: Params) -> Params:
        return Params(self.tp + other.tp, self.replicated + other.replicated, self.expert + other.expert)

    @property
    def total(self) -> int:
        """All parameters."""
        return self.tp + self.replicated + self.expert


def _sum(parts) -> Params:
    total = Params()
    for part in parts:
        total = total + part
    return total


# ---------------------------------------------------------------------------------------------------------------
# Parameter counts from the HF config


def topk(hf_config: dict) -> int:
    """Routed experts per token."""
    return int(hf_config.get("num_experts_per_tok") or 0)


def _has_qk_norm(arch: ModelArch) -> bool:
    return arch.family in ("qwen3", "qwen3_moe")


def attention_params(arch: ModelArch) -> Params:
    """One layer's attention with its input norm: GQA (q, k, v, o, optional biases and q/k norms) or MLA."""
    h = arch.hidden_size
    if arch.family == "deepseek_v3":
        heads, q_lora, kv_lora = arch.num_heads, arch.get("q_lora_rank"), arch.get("kv_lora_rank")
        nope, rope, v = arch.get("qk_nope_head_dim"), arch.get("qk_rope_head_dim"), arch.get("v_head_dim")
        q_head = nope + rope
        if q_lora:  # q_a_proj + q_a_layernorm are whole on every rank, q_b_proj is split by heads
            q_tp, q_rep = q_lora * heads * q_head, h * q_lora + q_lora
        else:
            q_tp, q_rep = h * heads * q_head, 0
        kv_rep = h * (kv_lora + rope) + kv_lora  # kv_a_proj_with_mqa + kv_a_layernorm
        kv_tp = kv_lora * heads * (nope + v)  # kv_b_proj
        out = heads * v * h
        return Params(tp=q_tp + kv_tp + out, replicated=q_rep + kv_rep + h)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    weights = h * (q + 2 * kv) + q * h
    bias = (q + 2 * kv) if arch.qkv_bias else 0
    norms = h + (2 * arch.head_dim if _has_qk_norm(arch) else 0)
    return Params(tp=weights + bias, replicated=norms)


def mlp_params(arch: ModelArch, layer: int, active: bool = False, k: int = 0) -> Params:
    """One layer's MLP with its input norm: dense SwiGLU, or router + routed experts (+ shared experts).

    With `active`, only the `k` routed experts one token uses are counted.
    """
    h = arch.hidden_size
    if not arch.is_moe_layer(layer):
        return Params(tp=3 * h * arch.ffn_hidden_size, replicated=h)
    experts = k if active else arch.num_experts
    router = arch.num_experts * h  # DeepSeek's expert score bias is a buffer (not trained), left out
    return Params(
        tp=3 * h * arch.shared_expert_ffn_hidden_size,
        replicated=router + h,
        expert=experts * 3 * h * arch.moe_ffn_hidden_size,
    )


def layer_params(arch: ModelArch, layer: int, active: bool = False, k: int = 0) -> Params:
    """One transformer layer (attention + MLP with their norms)."""
    return attention_params(arch) + mlp_params(arch, layer, active, k)


def embedding_params(arch: ModelArch) -> Params:
    """The input embedding (split over the vocabulary by tensor parallel)."""
    return Params(tp=arch.vocab_size * arch.hidden_size)


def head_params(arch: ModelArch, pp: int = 1) -> Params:
    """Final norm plus output layer; a tied output layer is the embedding itself, except that with pp > 1
    Megatron keeps a copy of it on the last stage."""
    output = 0 if arch.tie_word_embeddings and pp == 1 else arch.vocab_size * arch.hidden_size
    return Params(tp=output, replicated=arch.hidden_size)


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Whole-model parameter counts."""

    total: int
    """Every parameter (embedding, layers, final norm, output layer unless tied)."""
    active: int
    """Parameters one token uses (only `num_experts_per_tok` routed experts per MoE layer)."""
    expert: int
    """Routed-expert parameters."""


def model_size(arch: ModelArch, hf_config: dict) -> ModelSize:
    """Total, active and routed-expert parameters from the HF config."""
    layers = range(arch.num_layers)
    ends = embedding_params(arch) + head_params(arch)
    total = ends + _sum(layer_params(arch, i) for i in layers)
    active = ends + _sum(layer_params(arch, i, active=True, k=topk(hf_config)) for i in layers)
    return ModelSize(total=total.total, active=active.total, expert=total.expert)


def stage_params(arch: ModelArch, layout: ParallelLayout, stage: int, layers: range) -> Params:
    """Parameters of one pipeline stage (its layers, the embedding on the first, the head on the last)."""
    params = _sum(layer_params(arch, i) for i in layers)
    if stage == 0:
        params = params + embedding_params(arch)
    if stage == layout.pp - 1:
        params = params + head_params(arch, layout.pp)
    return params


# ---------------------------------------------------------------------------------------------------------------
# Activations


def layer_activation_bytes(arch: ModelArch, hf_config: dict, layer: int, tokens: int, layout: ParallelLayout,
                           act_bytes: int) -> int:  # fmt: skip
    """Activation bytes one layer keeps for its backward pass, for `tokens` = micro_batch_size * seq_len.

    Korthikanti et al. count 34 * s*b*h bytes (bf16) per GPT layer with a 4h MLP, divided by t under tensor +
    sequence parallelism, plus 5*a*s^2*b for the attention scores, which flash attention does not store. The same
    bookkeeping for these models, in elements of T = s*b tokens (no dropout masks: dropout is off):
    - attention, GQA: norm input h, QKV input h, q/k/v outputs q + 2kv, core-attention output q -> T(2h + 2q + 2kv)
    - attention, MLA: norm input h, down-projection input h, q/kv latents and their norms 2(q_lora + kv_lora),
      rope part r, full q and k heads*(nope+r) each, kv up-projection output heads*(nope+v), core output
      heads*v -> T(2h + 2q_lora + 2kv_lora + r + heads*(2(nope+r) + nope + 2v))
    - dense SwiGLU MLP (width f): norm input h, fc1 input h, fc1 output 2f, activation output f -> T(2h + 3f)
    - MoE: norm input and router input 2h, router scores (fp32) 2E, shared expert 3f_s, and per routed token copy
      (T*k of them): permuted input h, fc1 output 2f_e, activation f_e, unpermuted output h -> T(2h + 2E + 3f_s)
      + T*k(2h + 3f_e).
    Everything is divided by tp (sequence parallel shards the token dimension; balanced routing gives each
    expert-parallel rank T*k/tp token copies; expert tensor parallel all-gathers tokens over etp ranks and
    splits the widths: T*k/tp * (2h*etp + 3f_e)).
    """
    h, t = arch.hidden_size, layout.tp
    if arch.family == "deepseek_v3":
        heads, q_lora, kv_lora = arch.num_heads, arch.get("q_lora_rank") or 0, arch.get("kv_lora_rank")
        nope, rope, v = arch.get("qk_nope_head_dim"), arch.get("qk_rope_head_dim"), arch.get("v_head_dim")
        attention = 2 * h + 2 * q_lora + 2 * kv_lora + rope + heads * (2 * (nope + rope) + nope + 2 * v)
    else:
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        attention = 2 * h + 2 * q + 2 * kv
    elements = tokens * attention
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


# ---------------------------------------------------------------------------------------------------------------
# The plan


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
    """micro_batch_size * model.max_sequence_length."""
    stages: list[StageMemory]
    """Per-GPU memory of each stage."""
    gpu_memory_bytes: int
    """Memory of one GPU."""

    @property
    def worst(self) -> StageMemory:
        """The stage that needs the most memory."""
        return max(self.stages, key=lambda s: s.total_bytes)


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run config planned against its cluster."""

    name: str
    """Run name."""
    family: str
    """Model family."""
    model_source: str
    """Where the model shape came from (a config.json path, or `tiny <family>`)."""
    size: ModelSize
    """Parameter counts."""
    gpu: str
    """GPU type."""
    trainer_gpus: int
    """GPUs of the trainer."""
    inference_gpus: int
    """GPUs of the engines."""
    trainer: TrainerPlan
    """Trainer memory."""
    engines: EnginePlan
    """Engine memory."""

    def to_dict(self) -> dict:
        """A JSON-ready summary in GB (10^9 bytes) and billions of parameters."""
        worst = self.trainer.worst
        return {
            "name": self.name,
            "family": self.family,
            "model_source": self.model_source,
            "params_b": {"total": _b(self.size.total), "active": _b(self.size.active), "expert": _b(self.size.expert)},
            "gpu": self.gpu,
            "gpu_memory_gb": _gb(self.trainer.gpu_memory_bytes),
            "trainer": {
                "gpus": self.trainer_gpus,
                "layout": self.trainer.layout,
                "stage_layers": self.trainer.stage_layers,
                "microbatches": self.trainer.microbatches,
                "tokens_per_microbatch": self.trainer.tokens_per_microbatch,
                "worst_stage": worst.stage,
                "per_gpu_gb": _stage_gb(worst),
                "stages_total_gb": [_gb(s.total_bytes) for s in self.trainer.stages],
            },
            "inference": {
                "gpus": self.inference_gpus,
                "engines": self.engines.num_engines,
                "gpus_per_engine": self.engines.gpus_per_engine,
                "per_gpu_gb": {
                    "weights": _gb(self.engines.weight_bytes),
                    "overhead": _gb(self.engines.overhead_bytes),
                    "kv_cache": _gb(self.engines.kv_cache_bytes),
                    "budget": _gb(self.engines.budget_bytes),
                },
                "kv_bytes_per_token": self.engines.kv_bytes_per_token,
                "kv_cache_tokens_per_replica": self.engines.kv_cache_tokens,
                "max_sequences_per_replica": self.engines.max_sequences,
            },
        }


def _gb(nbytes: int) -> float:
    return round(nbytes / GB, 2)


def _b(count: int) -> float:
    return round(count / 1e9, 3)


def _stage_gb(stage: StageMemory) -> dict:
    return {
        "params": _gb(stage.param_bytes),
        "grads": _gb(stage.grad_bytes),
        "optimizer": _gb(stage.optimizer_bytes),
        "activations": _gb(stage.activation_bytes),
        "overhead": _gb(stage.overhead_bytes),
        "total": _gb(stage.total_bytes),
    }


def _layout(cfg: RunConfig) -> ParallelLayout:
    return layout_from_config(cfg.trainer.parallel)


def load_model_config(cfg: RunConfig) -> tuple[dict, str]:
    """The HF config.json dict to plan with and where it came from.

    `model.hf_config` first (a relative path is tried from the working directory, then from the repository
    root, so `configs/models/...` works from anywhere in a checkout), then `model.hf_path/config.json`, then
    with `model.make_tiny` the tiny model `make-tiny` creates for `model.family` when hf_path is missing.
    """
    if cfg.model.hf_config:
        path = Path(cfg.model.hf_config)
        candidates = [path] if path.is_absolute() else [path, _REPO_ROOT / path]
        for candidate in candidates:
            if candidate.is_file():
                return _read_json(candidate), str(cfg.model.hf_config)
        raise PlanError(f"model.hf_config={cfg.model.hf_config!r}: no such file")
    path = Path(cfg.model.hf_path) / "config.json"
    if cfg.model.hf_path and path.is_file():
        return _read_json(path), str(path)
    if cfg.model.make_tiny:
        return get_family(cfg.model.family).tiny_hf_config(TINY_VOCAB), f"tiny {cfg.model.family}"
    raise PlanError(
        f"model.hf_path={cfg.model.hf_path!r} has no config.json and model.hf_config is empty: set model.hf_config"
        " to the model's config.json (see configs/models/)"
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlanError(f"{path}: unreadable config.json ({err})") from None


def check_cluster(cfg: RunConfig, layout: ParallelLayout) -> tuple[int, int]:
    """Trainer and engine GPU counts; PlanError when they do not match the declared nodes."""
    c, r = cfg.cluster, cfg.rollout
    engine_gpus = r.num_engines * r.engine_tp * r.engine_dp
    if (c.trainer_nodes is None) != (c.inference_nodes is None):
        raise PlanError(
            f"cluster.trainer_nodes={c.trainer_nodes}, cluster.inference_nodes={c.inference_nodes}: set both"
            " (a multi-node run) or neither (trainer and engines share one node)"
        )
    if c.trainer_nodes is None:
        if layout.world_size + engine_gpus > c.gpus_per_node:
            raise PlanError(
                f"cluster.trainer_nodes is empty (one shared node), but the trainer's {layout.world_size} GPUs plus"
                f" the engines' {engine_gpus} exceed cluster.gpus_per_node={c.gpus_per_node}"
            )
        return layout.world_size, engine_gpus
    trainer_gpus = c.trainer_nodes * c.gpus_per_node
    if layout.world_size != trainer_gpus:
        raise PlanError(
            f"cluster.trainer_nodes={c.trainer_nodes} x gpus_per_node={c.gpus_per_node} = {trainer_gpus} GPUs, but"
            f" trainer.parallel gives tp*pp*dp = {layout.tp}*{layout.pp}*{layout.data_parallel} ="
            f" {layout.world_size} ({layout.describe()})"
        )
    inference_gpus = c.inference_nodes * c.gpus_per_node
    if engine_gpus != inference_gpus:
        raise PlanError(
            f"cluster.inference_nodes={c.inference_nodes} x gpus_per_node={c.gpus_per_node} = {inference_gpus} GPUs,"
            f" but rollout.num_engines*engine_tp*engine_dp = {r.num_engines}*{r.engine_tp}*{r.engine_dp} ="
            f" {engine_gpus}"
        )
    return trainer_gpus, inference_gpus


def plan_trainer(cfg: RunConfig, arch: ModelArch, hf_config: dict, layout: ParallelLayout) -> TrainerPlan:
    """Per-GPU memory of every pipeline stage of the trainer."""
    t = cfg.trainer
    dtype_bytes = _DTYPE_BYTES[cfg.model.dtype]
    # Adam m and v in fp32, plus an fp32 main copy when the parameters are in a lower precision.
    state_bytes = 8 + (4 if dtype_bytes < 4 else 0)
    dense_shards = layout.data_parallel if t.optimizer.use_distributed_optimizer else 1
    expert_shards = layout.expert_data_parallel if t.optimizer.use_distributed_optimizer else 1
    tokens = t.micro_batch_size * cfg.model.max_sequence_length
    sequences = cfg.prompts_per_step * cfg.rollout.samples_per_prompt
    microbatches = max(1, math.ceil(sequences / (t.micro_batch_size * layout.data_parallel)))
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
                stage=stage, layers=count, params=local, param_bytes=dtype_bytes * local, grad_bytes=4 * local,
                optimizer_bytes=optimizer, activation_bytes=activations, overhead_bytes=overhead,
            )
        )  # fmt: skip
    return TrainerPlan(
        layout=layout.describe(), world_size=layout.world_size, stage_layers=counts, microbatches=microbatches,
        tokens_per_microbatch=tokens, stages=stages, gpu_memory_bytes=int(cfg.cluster.memory_gb * GB),
    )  # fmt: skip


def check_engine_layout(cfg: RunConfig, arch: ModelArch) -> None:
    """PlanError when vLLM cannot shard the model at engine_tp / engine_dp / engine_ep."""
    r = cfg.rollout
    if arch.num_heads % r.engine_tp:
        raise PlanError(f"rollout.engine_tp={r.engine_tp}: the model's attention heads ({arch.num_heads}) are not"
                        f" divisible by {r.engine_tp}")  # fmt: skip
    kv = arch.num_kv_heads
    if arch.family != "deepseek_v3" and kv % r.engine_tp and r.engine_tp % kv:
        raise PlanError(f"rollout.engine_tp={r.engine_tp}: neither divides nor is a multiple of the model's key/value"
                        f" heads ({kv})")  # fmt: skip
    if not arch.num_experts:
        return
    if r.engine_ep and arch.num_experts % (r.engine_tp * r.engine_dp):
        raise PlanError(
            f"rollout.engine_ep=true: the model's experts ({arch.num_experts}) are not divisible by engine_tp *"
            f" engine_dp = {r.engine_tp * r.engine_dp}"
        )
    if not r.engine_ep and arch.moe_ffn_hidden_size % r.engine_tp:
        raise PlanError(f"rollout.engine_tp={r.engine_tp}: the expert MLP width ({arch.moe_ffn_hidden_size}) is not"
                        f" divisible by {r.engine_tp}")  # fmt: skip


def kv_bytes_per_token(arch: ModelArch, engine_tp: int, dtype_bytes: int) -> int:
    """KV cache bytes of one token (all layers) on one engine GPU."""
    if arch.family == "deepseek_v3":  # the MLA latent and the rope key, the same on every TP rank
        per_layer = arch.get("kv_lora_rank") + arch.get("qk_rope_head_dim")
    else:  # vLLM replicates key/value heads when engine_tp exceeds them
        per_layer = 2 * max(1, arch.num_kv_heads // engine_tp) * arch.head_dim
    return per_layer * arch.num_layers * dtype_bytes


def plan_engines(cfg: RunConfig, arch: ModelArch) -> EnginePlan:
    """Per-GPU weights and KV-cache room of the vLLM engines."""
    check_engine_layout(cfg, arch)
    r = cfg.rollout
    dtype_bytes = _DTYPE_BYTES[cfg.model.dtype]
    whole = embedding_params(arch) + head_params(arch) + _sum(layer_params(arch, i) for i in range(arch.num_layers))
    expert_split = r.engine_tp * r.engine_dp if r.engine_ep else r.engine_tp
    weights = dtype_bytes * (
        math.ceil(whole.tp / r.engine_tp) + whole.replicated + math.ceil(whole.expert / expert_split)
    )
    memory = int(cfg.cluster.memory_gb * GB)
    budget = int(r.gpu_memory_utilization * memory)
    # The receiver holds RECEIVE_BUFFERS (3) buckets: one being loaded, two arriving (weights/receiver.py).
    overhead = ENGINE_OVERHEAD_BYTES + 3 * cfg.sync.bucket_mb * 2**20
    room = budget - weights - overhead
    per_token = kv_bytes_per_token(arch, r.engine_tp, dtype_bytes)
    tokens = max(0, room) // per_token
    return EnginePlan(
        num_engines=r.num_engines, gpus_per_engine=r.engine_tp * r.engine_dp, weight_bytes=weights,
        overhead_bytes=overhead, budget_bytes=budget, kv_cache_bytes=room, kv_bytes_per_token=per_token,
        kv_cache_tokens=tokens, max_sequences=tokens // cfg.model.max_sequence_length, gpu_memory_bytes=memory,
    )  # fmt: skip


def _check_fits(cfg: RunConfig, trainer: TrainerPlan, engines: EnginePlan) -> None:
    worst = trainer.worst
    if worst.total_bytes > trainer.gpu_memory_bytes:
        parts = ", ".join(f"{k} {v}" for k, v in _stage_gb(worst).items())
        raise PlanError(
            f"trainer.parallel ({trainer.layout}), trainer.micro_batch_size={cfg.trainer.micro_batch_size},"
            f" trainer.recompute={cfg.trainer.recompute}: pipeline stage {worst.stage} needs"
            f" {_gb(worst.total_bytes)} GB per GPU ({parts}), more than cluster.gpu_memory_gb ="
            f" {_gb(trainer.gpu_memory_bytes)} ({cfg.cluster.gpu})"
        )
    if engines.max_sequences < 1:
        raise PlanError(
            f"rollout.engine_tp={cfg.rollout.engine_tp}, engine_dp={cfg.rollout.engine_dp}, engine_ep="
            f"{cfg.rollout.engine_ep}, gpu_memory_utilization={cfg.rollout.gpu_memory_utilization}: weights"
            f" {_gb(engines.weight_bytes)} GB + overhead {_gb(engines.overhead_bytes)} GB per GPU leave"
            f" {_gb(engines.kv_cache_bytes)} GB of the {_gb(engines.budget_bytes)} GB budget for the KV cache, not"
            f" enough for one sequence of model.max_sequence_length={cfg.model.max_sequence_length}"
        )


def plan(cfg: RunConfig, hf_config: dict | None = None, model_source: str = "") -> Plan:
    """Plan a run config (with the model's HF config dict, read per `load_model_config` when not given)."""
    if hf_config is None:
        hf_config, model_source = load_model_config(cfg)
    try:
        family = get_family(cfg.model.family) if cfg.model.family else family_for_hf_config(hf_config)
        arch = family.arch_from_hf(hf_config, model_source or "config.json")
    except (CheckpointError, ValueError) as err:
        raise PlanError(f"model ({model_source or 'config.json'}): {err}") from None
    layout = _layout(cfg)
    try:
        check_layout_fits_model(layout, arch)
    except LayoutError as err:
        raise PlanError(f"trainer.{err}") from None
    trainer_gpus, inference_gpus = check_cluster(cfg, layout)
    trainer = plan_trainer(cfg, arch, hf_config, layout)
    engines = plan_engines(cfg, arch)
    _check_fits(cfg, trainer, engines)
    return Plan(
        name=cfg.name, family=family.name, model_source=model_source, size=model_size(arch, hf_config),
        gpu=cfg.cluster.gpu, trainer_gpus=trainer_gpus, inference_gpus=inference_gpus, trainer=trainer,
        engines=engines,
    )  # fmt: skip


def format_plan(p: Plan) -> str:
    """A readable table of a plan."""
    d = p.to_dict()
    tr, inf = d["trainer"], d["inference"]
    lines = [
        f"{p.name}: {p.family} ({p.model_source}), {d['params_b']['total']}B parameters"
        f" ({d['params_b']['active']}B active), {p.gpu} {d['gpu_memory_gb']} GB",
        f"trainer   {tr['gpus']} GPUs  {tr['layout']}  stage layers {tr['stage_layers']}"
        f"  {tr['microbatches']} microbatches of {tr['tokens_per_microbatch']} tokens",
        f"  {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'other':>8} {'total':>8}  (GB per GPU)",
    ]
    for s in p.trainer.stages:
        g = _stage_gb(s)
        lines.append(
            f"  {s.stage:>5} {g['params']:>8} {g['grads']:>8} {g['optimizer']:>8} {g['activations']:>8}"
            f" {g['overhead']:>8} {g['total']:>8}"
        )
    e = inf["per_gpu_gb"]
    lines += [
        f"engines   {inf['gpus']} GPUs  {inf['engines']} x {inf['gpus_per_engine']} GPUs",
        f"  weights {e['weights']} GB + overhead {e['overhead']} GB of a {e['budget']} GB budget -> KV cache"
        f" {e['kv_cache']} GB = {inf['kv_cache_tokens_per_replica']} tokens per replica"
        f" ({inf['kv_bytes_per_token']} B/token), {inf['max_sequences_per_replica']} full-length sequences",
    ]
    return "\n".join(lines)
