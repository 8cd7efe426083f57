"""Local Megatron parameter names (per pipeline stage / expert rank, local or TE spec) <-> canonical names.

A canonical name uses global layer and expert indices and the local-spec spelling, so one parameter map serves
every layout and both layer specs.
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_TE_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# Transformer Engine fuses a norm into the linear after it; these are the local-spec names of those norms.
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_proj.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def canonical_name(local: str, layer_offset: int, expert_offset: int) -> str:
    """Canonical name of a local parameter: global layer/expert indices, local-spec spelling."""
    name = local
    grouped = _TE_GROUPED_EXPERT.search(name)
    if grouped:
        fc, kind, expert = grouped.groups()
        name = name[: grouped.start()] + f".mlp.experts.local_experts.{expert}.{fc}.{kind}"
    layer = _LAYER.match(name)
    if layer:
        rest = name[layer.end() :]
        rest = _TE_FUSED_NORMS.get(rest, rest)
        name = f"decoder.layers.{int(layer.group(1)) + layer_offset}.{rest}"
    expert = _LOCAL_EXPERT.search(name)
    if expert:
        global_expert = int(expert.group(1)) + expert_offset
        name = name[: expert.start()] + f".mlp.experts.local_experts.{global_expert}." + name[expert.end() :]
    return name


def is_expert_param(name: str) -> bool:
    """Whether a (local or canonical) name is a routed expert's weight."""
    return ".mlp.experts." in name
