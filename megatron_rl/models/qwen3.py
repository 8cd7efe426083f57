"""Qwen3 dense models: GQA with per-head q/k RMSNorm and a SwiGLU MLP in every layer."""

from __future__ import annotations

from megatron_rl.models import common
from megatron_rl.models.base import ModelArch, ModelFamily, ParamRule, require


class Qwen3Family(ModelFamily):
    """Qwen3 dense (Qwen3-0.6B ... Qwen3-32B)."""

    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_model_types = ("qwen3",)
    qk_norm = True

    def _read_arch(self, hf_config: dict) -> ModelArch:
        """Read layers, heads and MLP width."""
        where = f"{self.name} config"
        return ModelArch(
            family=self.name,
            ffn_hidden_size=int(require(hf_config, "intermediate_size", where)),
            **common.gqa_dims(hf_config, where),
        )

    def megatron_config_kwargs(self, arch: ModelArch, hf_config: dict) -> dict:
        """GQA with q/k norm, SwiGLU, RMSNorm."""
        return common.gqa_config_kwargs(arch, hf_config, qk_norm=self.qk_norm)

    def param_rules(self, arch: ModelArch) -> list[ParamRule]:
        """Embeddings, then per layer attention and dense MLP."""
        rules = common.embedding_rules(arch)
        for layer in range(arch.num_layers):
            rules += common.gqa_attention_rules(arch, layer, qk_norm=self.qk_norm)
            rules.append(common.pre_mlp_norm_rule(layer))
            rules += common.dense_mlp_rules(layer)
        return rules

    def tiny_hf_config(self, vocab_size: int) -> dict:
        """Two layers, hidden 128, head_dim 32, tied embeddings (as the small Qwen3 checkpoints)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
