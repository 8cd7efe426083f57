"""Mixtral (8x7B, 8x22B): GQA without q/k norm, every layer a top-2 softmax MoE with `w1/w3/w2` experts."""

from __future__ import annotations

from megatron_rl.models import common
from megatron_rl.models.base import ModelArch, ModelFamily, ParamRule, require


class MixtralFamily(ModelFamily):
    """Mixtral; published checkpoints name the MoE block `block_sparse_moe`."""

    name = "mixtral"
    hf_architectures = ("MixtralForCausalLM",)
    hf_model_types = ("mixtral",)

    def _read_arch(self, hf_config: dict) -> ModelArch:
        """Read layers, heads and experts; `intermediate_size` is each expert's width."""
        where = f"{self.name} config"
        dims = common.gqa_dims(hf_config, where)
        ffn = int(require(hf_config, "intermediate_size", where))
        return ModelArch(
            family=self.name,
            ffn_hidden_size=ffn,
            num_experts=int(require(hf_config, "num_local_experts", where)),
            moe_ffn_hidden_size=ffn,
            moe_layers=tuple(range(dims["num_layers"])),
            **dims,
        )

    def megatron_config_kwargs(self, arch: ModelArch, hf_config: dict) -> dict:
        """Top-k softmax routing with renormalisation (Megatron's default, not pre-softmax)."""
        kwargs = common.gqa_config_kwargs(arch, hf_config, qk_norm=self.qk_norm)
        kwargs.update(
            moe_router_topk=int(hf_config.get("num_experts_per_tok", 2)),
            moe_router_pre_softmax=False,
            moe_router_score_function="softmax",
            moe_aux_loss_coeff=float(hf_config.get("router_aux_loss_coef", 0.02)),
        )
        return kwargs

    def param_rules(self, arch: ModelArch) -> list[ParamRule]:
        """Embeddings, then per layer attention and `block_sparse_moe`."""
        rules = common.embedding_rules(arch)
        for layer in range(arch.num_layers):
            rules += common.gqa_attention_rules(arch, layer, qk_norm=self.qk_norm)
            rules.append(common.pre_mlp_norm_rule(layer))
            rules += common.moe_rules(
                arch, layer, "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.", ("w1", "w3", "w2")
            )
        return rules

    def tiny_hf_config(self, vocab_size: int) -> dict:
        """Two layers, hidden 128, 4 experts top-2, head_dim 32."""
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
