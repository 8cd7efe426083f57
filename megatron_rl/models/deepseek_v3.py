"""DeepSeek-V3 (and V3.1/R1): multi-latent attention, first-k dense layers, shared experts, and a sigmoid router
with expert score-correction bias and grouped top-k.

Facts this map relies on (measured, see shared/STACK.md): Megatron's MLA de-interleaves the rope slice as HF does
with `rope_interleave=True`; `qk_layernorm` must be on or the q/kv latent norms vanish; up projections are
column-parallel; down projections are column-parallel in the local spec and duplicated in the TE spec.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.models import common
from megatron_rl.models.base import (
    AttentionParams,
    CheckpointError,
    ModelArch,
    ModelFamily,
    ParamRule,
    require,
    rope_theta,
)

_ATTN = {
    # Megatron (under self_attention.) -> (HF under self_attn., tensor-parallel dim). With the local spec the
    # down projections are column-parallel (their output is gathered before the latent norm); the TE spec
    # duplicates them instead (see `te_variant`).
    "linear_q_down_proj.weight": ("q_a_proj.weight", 0),
    "q_layernorm.weight": ("q_a_layernorm.weight", None),
    "linear_q_up_proj.weight": ("q_b_proj.weight", 0),
    "linear_kv_down_proj.weight": ("kv_a_proj_with_mqa.weight", 0),
    "kv_layernorm.weight": ("kv_a_layernorm.weight", None),
    "linear_kv_up_proj.weight": ("kv_b_proj.weight", 0),
    "linear_proj.weight": ("o_proj.weight", 1),
}
_ATTN_NO_Q_LORA = {"linear_q_proj.weight": ("q_proj.weight", 0)}


def _mla_dims(arch: ModelArch) -> tuple[int, ...]:
    """hidden, heads, q_lora_rank (0 without a q down projection), kv_lora_rank, nope, rope and v head widths."""
    get = arch.get
    return (arch.hidden_size, arch.num_heads, get("q_lora_rank") or 0, get("kv_lora_rank"), get("qk_nope_head_dim"),
            get("qk_rope_head_dim"), get("v_head_dim"))  # fmt: skip


class DeepseekV3Family(ModelFamily):
    """DeepSeek-V3 with the local or Transformer Engine MLA spec."""

    name = "deepseek_v3"
    hf_architectures = ("DeepseekV3ForCausalLM",)
    hf_model_types = ("deepseek_v3",)

    def uses_mla(self) -> bool:
        """DeepSeek-V3 attention is multi-latent."""
        return True

    def attention_params(self, arch: ModelArch) -> AttentionParams:
        """MLA with its input norm: the up and output projections split by heads; the down projections and their
        latent norms whole on every rank (as the Transformer Engine spec builds them)."""
        h, heads, q_lora, kv_lora, nope, rope, v = _mla_dims(arch)
        if q_lora:  # q_a_proj + q_a_layernorm are whole on every rank, q_b_proj is split by heads
            q_tp, q_rep = q_lora * heads * (nope + rope), h * q_lora + q_lora
        else:
            q_tp, q_rep = h * heads * (nope + rope), 0
        kv_rep = h * (kv_lora + rope) + kv_lora  # kv_a_proj_with_mqa + kv_a_layernorm
        kv_tp = kv_lora * heads * (nope + v)  # kv_b_proj
        out = heads * v * h
        return AttentionParams(tp=q_tp + kv_tp + out, replicated=q_rep + kv_rep + h)

    def attention_activation_elements(self, arch: ModelArch) -> int:
        """MLA: norm input h, down-projection input h, q/kv latents and their norms 2(q_lora + kv_lora), rope part
        r, full q and k heads*(nope+r) each, kv up-projection output heads*(nope+v), core output heads*v
        -> 2h + 2q_lora + 2kv_lora + r + heads*(2(nope+r) + nope + 2v)."""
        h, heads, q_lora, kv_lora, nope, rope, v = _mla_dims(arch)
        return 2 * h + 2 * q_lora + 2 * kv_lora + rope + heads * (2 * (nope + rope) + nope + 2 * v)

    def kv_cache_elements(self, arch: ModelArch, engine_tp: int) -> int:
        """The MLA latent and the rope key, the same on every TP rank."""
        return arch.get("kv_lora_rank") + arch.get("qk_rope_head_dim")

    def kv_heads_fit(self, arch: ModelArch, engine_tp: int) -> bool:
        """MLA caches one latent per token, not per-head keys and values: any engine_tp places it."""
        return True

    def te_variant(self, rule: ParamRule) -> ParamRule:
        """Transformer Engine builds the MLA down projections duplicated on every TP rank."""
        if rule.mcore.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
            return dataclasses.replace(rule, tp_dim=None)
        return rule

    def _read_arch(self, hf_config: dict) -> ModelArch:
        """Read MLA ranks, dense/MoE layer split and expert counts."""
        where = f"{self.name} config"
        num_layers = int(require(hf_config, "num_hidden_layers", where))
        first_dense = int(hf_config.get("first_k_dense_replace", 0))
        freq = int(hf_config.get("moe_layer_freq", 1) or 1)
        num_experts = int(require(hf_config, "n_routed_experts", where))
        moe_ffn = int(require(hf_config, "moe_intermediate_size", where))
        heads = int(require(hf_config, "num_attention_heads", where))
        rope_interleave = hf_config.get("rope_interleave", True)
        if rope_interleave is False:
            raise CheckpointError(f"{where}: rope_interleave=False is not supported (Megatron's MLA interleaves)")
        q_lora_rank = hf_config.get("q_lora_rank")
        extra = {
            "q_lora_rank": int(q_lora_rank) if q_lora_rank else 0,
            "kv_lora_rank": int(require(hf_config, "kv_lora_rank", where)),
            "qk_nope_head_dim": int(require(hf_config, "qk_nope_head_dim", where)),
            "qk_rope_head_dim": int(require(hf_config, "qk_rope_head_dim", where)),
            "v_head_dim": int(require(hf_config, "v_head_dim", where)),
        }
        return ModelArch(
            family=self.name,
            num_layers=num_layers,
            hidden_size=int(require(hf_config, "hidden_size", where)),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"],
            vocab_size=int(require(hf_config, "vocab_size", where)),
            ffn_hidden_size=int(require(hf_config, "intermediate_size", where)),
            num_experts=num_experts,
            moe_ffn_hidden_size=moe_ffn,
            moe_layers=tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
            shared_expert_ffn_hidden_size=moe_ffn * int(hf_config.get("n_shared_experts") or 0),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            extra=tuple(sorted(extra.items())),
        )

    def megatron_config_kwargs(self, arch: ModelArch, hf_config: dict) -> dict:
        """MLATransformerConfig kwargs: plain rope (YaRN only when the checkpoint asks), sigmoid grouped router."""
        scaling = hf_config.get("rope_scaling") or {}
        rope_type = "yarn" if scaling.get("type", scaling.get("rope_type")) == "yarn" else "rope"
        kwargs = common.base_config_kwargs(arch, hf_config)
        kwargs.update(
            qk_layernorm=True,
            multi_latent_attention=True,
            q_lora_rank=arch.get("q_lora_rank") or None,
            kv_lora_rank=arch.get("kv_lora_rank"),
            qk_head_dim=arch.get("qk_nope_head_dim"),
            qk_pos_emb_head_dim=arch.get("qk_rope_head_dim"),
            v_head_dim=arch.get("v_head_dim"),
            rope_type=rope_type,
            rotary_base=rope_theta(hf_config),
            rotary_scaling_factor=float(scaling.get("factor", 1.0)) if rope_type == "yarn" else 1.0,
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_layer_freq=[1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_layers)],
            moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
            moe_router_topk=int(hf_config.get("num_experts_per_tok", 8)),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(hf_config.get("routed_scaling_factor", 1.0)),
            moe_router_num_groups=int(hf_config.get("n_group", 1) or 1),
            moe_router_group_topk=int(hf_config.get("topk_group", 1) or 1),
            moe_router_pre_softmax=False,
            moe_aux_loss_coeff=0.0,
        )
        if rope_type == "yarn":
            kwargs.update(
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
                beta_fast=float(scaling.get("beta_fast", 32)),
                beta_slow=float(scaling.get("beta_slow", 1)),
                mscale=float(scaling.get("mscale", 1.0)),
                mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
            )
        return kwargs

    def param_rules(self, arch: ModelArch) -> list[ParamRule]:
        """Embeddings; per layer MLA, then a dense MLP (first k layers) or router + experts + shared experts."""
        rules = common.embedding_rules(arch)
        attn = dict(_ATTN)
        if not arch.get("q_lora_rank"):
            for key in ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight"):
                attn.pop(key)
            attn.update(_ATTN_NO_Q_LORA)
        for layer in range(arch.num_layers):
            m = common.DECODER.format(layer=layer)
            h = f"model.layers.{layer}."
            rules.append(ParamRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), layer=layer))
            for mname, (hname, tp_dim) in attn.items():
                rules.append(
                    ParamRule(m + "self_attention." + mname, (h + "self_attn." + hname,), tp_dim=tp_dim, layer=layer)
                )
            rules.append(common.pre_mlp_norm_rule(layer))
            if not arch.is_moe_layer(layer):
                rules += common.dense_mlp_rules(layer)
                continue
            rules += common.moe_rules(arch, layer, "mlp.gate.weight", "mlp.experts.{expert}.")
            rules.append(
                ParamRule(m + "mlp.router.expert_bias", (h + "mlp.gate.e_score_correction_bias",), layer=layer)
            )
            if arch.shared_expert_ffn_hidden_size:
                rules += common.swiglu_rules(
                    m + "mlp.shared_experts.",
                    h + "mlp.shared_experts.",
                    ("gate_proj", "up_proj", "down_proj"),
                    layer=layer,
                )
        return rules

    def tiny_hf_config(self, vocab_size: int) -> dict:
        """Four layers (first dense), hidden 128, 8 experts in 2 groups, top-2, one shared expert."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 8,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 64,
            "q_lora_rank": 96,
            "qk_rope_head_dim": 32,
            "v_head_dim": 32,
            "qk_nope_head_dim": 32,
            "n_group": 2,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            # vLLM reads these (published DeepSeek-V3 configs carry them): without them it routes with softmax
            # and looks for no score-correction bias.
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "rope_interleave": True,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
