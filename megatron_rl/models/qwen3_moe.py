"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head q/k RMSNorm, softmax top-k router."""

from __future__ import annotations

from megatron_rl.models import common
from megatron_rl.models.base import ModelArch, ModelFamily, ParamRule, require


class Qwen3MoeFamily(ModelFamily):
    """Qwen3-MoE: every layer MoE unless listed in `mlp_only_layers` or skipped by `decoder_sparse_step`."""

    name = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    hf_model_types = ("qwen3_moe",)
    qk_norm = True

    def _read_arch(self, hf_config: dict) -> ModelArch:
        """Read layers, heads, experts and the MoE layer pattern."""
        where = f"{self.name} config"
        dims = common.gqa_dims(hf_config, where)
        num_experts = int(require(hf_config, ("num_experts", "num_local_experts"), where))
        sparse_step = int(hf_config.get("decoder_sparse_step", 1) or 1)
        dense_only = set(hf_config.get("mlp_only_layers") or [])
        moe_layers = tuple(
            i
            for i in range(dims["num_layers"])
            if num_experts > 0 and i not in dense_only and (i + 1) % sparse_step == 0
        )
        return ModelArch(
            family=self.name,
            ffn_hidden_size=int(require(hf_config, "intermediate_size", where)),
            num_experts=num_experts,
            moe_ffn_hidden_size=int(require(hf_config, "moe_intermediate_size", where)),
            moe_layers=moe_layers,
            **dims,
        )

    def megatron_config_kwargs(self, arch: ModelArch, hf_config: dict) -> dict:
        """GQA + q/k norm; HF `norm_topk_prob=False` is Megatron's pre-softmax routing."""
        kwargs = common.gqa_config_kwargs(arch, hf_config, qk_norm=self.qk_norm)
        kwargs.update(
            moe_router_topk=int(hf_config.get("num_experts_per_tok", 8)),
            moe_router_pre_softmax=not bool(hf_config.get("norm_topk_prob", True)),
            moe_router_score_function="softmax",
            moe_aux_loss_coeff=float(hf_config.get("router_aux_loss_coef", 0.001)),
        )
        return kwargs

    def param_rules(self, arch: ModelArch) -> list[ParamRule]:
        """Embeddings, then per layer attention and MoE (or dense) MLP."""
        rules = common.embedding_rules(arch)
        for layer in range(arch.num_layers):
            rules += common.gqa_attention_rules(arch, layer, qk_norm=self.qk_norm)
            rules.append(common.pre_mlp_norm_rule(layer))
            if arch.is_moe_layer(layer):
                rules += common.moe_rules(arch, layer, "mlp.gate.weight", "mlp.experts.{expert}.")
            else:
                rules += common.dense_mlp_rules(layer)
        return rules

    def tiny_hf_config(self, vocab_size: int) -> dict:
        """Two layers, hidden 128, 8 experts top-2, head_dim 32 (vLLM CPU attention needs >= 32)."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
