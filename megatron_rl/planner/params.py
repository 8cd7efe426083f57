"""Parameter counts from the model's Hugging Face config, split by how the parallel layouts shard them."""

from __future__ import annotations

import dataclasses

from megatron_rl.models import ModelArch, get_family
from megatron_rl.parallel.layout import ParallelLayout


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


def sum_params(parts) -> Params:
    """The sum of some Params."""
    total = Params()
    for part in parts:
        total = total + part
    return total


def topk(hf_config: dict) -> int:
    """Routed experts per token."""
    return int(hf_config.get("num_experts_per_tok") or 0)


def attention_params(arch: ModelArch) -> Params:
    """One layer's attention with its input norm, as the model's family counts it (GQA or MLA)."""
    counts = get_family(arch.family).attention_params(arch)
    return Params(tp=counts.tp, replicated=counts.replicated)


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
    total = ends + sum_params(layer_params(arch, i) for i in layers)
    active = ends + sum_params(layer_params(arch, i, active=True, k=topk(hf_config)) for i in layers)
    return ModelSize(total=total.total, active=active.total, expert=total.expert)


def stage_params(arch: ModelArch, layout: ParallelLayout, stage: int, layers: range) -> Params:
    """Parameters of one pipeline stage (its layers, the embedding on the first, the head on the last)."""
    params = sum_params(layer_params(arch, i) for i in layers)
    if stage == 0:
        params = params + embedding_params(arch)
    if stage == layout.pp - 1:
        params = params + head_params(arch, layout.pp)
    return params
