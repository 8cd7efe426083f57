"""Parameter-rule builders shared by the families with grouped-query attention and SwiGLU MLPs."""

from __future__ import annotations

from megatron_rl.models.base import ModelArch, ParamRule, require

DECODER = "decoder.layers.{layer}."


def embedding_rules(arch: ModelArch, hf_prefix: str = "model.") -> list[ParamRule]:
    """Input embedding, final norm and (untied) output layer."""
    rules = [
        ParamRule("embedding.word_embeddings.weight", (f"{hf_prefix}embed_tokens.weight",), tp_dim=0),
        ParamRule("decoder.final_layernorm.weight", (f"{hf_prefix}norm.weight",)),
    ]
    if not arch.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), tp_dim=0))
    return rules


def gqa_attention_rules(arch: ModelArch, layer: int, qk_norm: bool) -> list[ParamRule]:
    """Input norm, fused QKV (plus bias), optional per-head q/k norms, output projection of one layer."""
    m = DECODER.format(layer=layer)
    h = f"model.layers.{layer}."
    rules = [
        ParamRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), layer=layer),
        ParamRule(
            m + "self_attention.linear_qkv.weight",
            tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
            transform="qkv",
            tp_dim=0,
            layer=layer,
        ),
        ParamRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), tp_dim=1, layer=layer),
    ]
    if arch.qkv_bias:
        rules.append(
            ParamRule(
                m + "self_attention.linear_qkv.bias",
                tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"),
                transform="qkv",
                tp_dim=0,
                layer=layer,
            )
        )
    if qk_norm:
        rules += [
            ParamRule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), layer=layer),
            ParamRule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), layer=layer),
        ]
    return rules


def swiglu_rules(mcore_prefix: str, hf_prefix: str, names: tuple[str, str, str], **common) -> list[ParamRule]:
    """A gated MLP: Megatron's fused fc1 = [gate; up] and fc2 = down; `names` are the HF gate, up, down names."""
    gate, up, down = names
    return [
        ParamRule(
            mcore_prefix + "linear_fc1.weight",
            (f"{hf_prefix}{gate}.weight", f"{hf_prefix}{up}.weight"),
            transform="gate_up",
            tp_dim=0,
            tp_chunks=2,
            **common,
        ),
        ParamRule(mcore_prefix + "linear_fc2.weight", (f"{hf_prefix}{down}.weight",), tp_dim=1, **common),
    ]


def moe_rules(
    arch: ModelArch,
    layer: int,
    router_hf: str,
    expert_hf: str,
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> list[ParamRule]:
    """Router and routed experts of one MoE layer; `expert_hf` is a pattern with `{expert}`."""
    m = DECODER.format(layer=layer)
    rules = [ParamRule(m + "mlp.router.weight", (f"model.layers.{layer}.{router_hf}",), layer=layer)]
    for expert in range(arch.num_experts):
        rules += swiglu_rules(
            m + f"mlp.experts.local_experts.{expert}.",
            f"model.layers.{layer}." + expert_hf.format(expert=expert),
            expert_names,
            is_expert=True,
            layer=layer,
            expert=expert,
        )
    return rules


def dense_mlp_rules(layer: int, hf_mlp: str = "mlp.") -> list[ParamRule]:
    """A dense SwiGLU MLP of one layer."""
    return swiglu_rules(
        DECODER.format(layer=layer) + "mlp.",
        f"model.layers.{layer}.{hf_mlp}",
        ("gate_proj", "up_proj", "down_proj"),
        layer=layer,
    )


def pre_mlp_norm_rule(layer: int) -> ParamRule:
    """The norm before the MLP (HF `post_attention_layernorm`)."""
    return ParamRule(
        DECODER.format(layer=layer) + "pre_mlp_layernorm.weight",
        (f"model.layers.{layer}.post_attention_layernorm.weight",),
        layer=layer,
    )


def gqa_dims(hf_config: dict, where: str) -> dict:
    """The ModelArch fields every GQA family reads the same way from its HF config."""
    heads = int(require(hf_config, "num_attention_heads", where))
    hidden = int(require(hf_config, "hidden_size", where))
    return dict(
        num_layers=int(require(hf_config, "num_hidden_layers", where)),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads", heads)),
        head_dim=int(hf_config.get("head_dim") or hidden // heads),
        vocab_size=int(require(hf_config, "vocab_size", where)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf_config.get("attention_bias", False)),
    )


def base_config_kwargs(arch: ModelArch, hf_config: dict) -> dict:
    """TransformerConfig keyword arguments every family here shares: RMSNorm, SwiGLU, no linear biases."""
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        activation_func="silu",
        gated_linear_unit=True,
        add_bias_linear=False,
    )


def gqa_config_kwargs(arch: ModelArch, hf_config: dict, qk_norm: bool) -> dict:
    """TransformerConfig keyword arguments common to the GQA + SwiGLU + RMSNorm families."""
    kwargs = base_config_kwargs(arch, hf_config)
    kwargs.update(
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=qk_norm,
    )
    if arch.num_experts:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_layer_freq=[1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_layers)],
        )
    return kwargs
