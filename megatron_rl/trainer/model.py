"""Build Megatron-Core's GPTModel for a model family at this rank's place in the parallel layout."""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_rl.models import ModelArch, ModelFamily
from megatron_rl.models.base import rope_theta
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.parallel.layout import check_layout_fits_model
from megatron_rl.trainer.grouped_experts import use_grouped_local_experts

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How to build the model beyond what the checkpoint says."""

    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    moe_dispatcher: str = "alltoall"
    """Megatron MoE token dispatcher: alltoall or allgather."""
    use_te: bool | None = None
    """Transformer Engine layer spec; None uses it exactly when it imports and CUDA is present."""
    max_sequence_length: int = 4096
    """Longest sequence the rotary embedding is prepared for."""
    init_weights: bool = True
    """Randomly initialise parameters (off when a checkpoint overwrites them all anyway)."""
    moe_aux_loss_coeff: float | None = None
    """Override the family's load-balancing loss coefficient (0 switches it off)."""
    recompute: bool = False
    """Recompute every layer's activations in the backward pass (less memory, more compute)."""
    logit_temperature: float = 1.0
    """Divide the output logits by this (the engines' sampling temperature), so the trainer's logprobs are those of
    the tempered policy the rollouts were sampled from and importance ratios compare like with like."""
    grouped_experts: bool = True
    """Without Transformer Engine, compute the routed experts with one grouped matmul per linear
    (`grouped_experts.GroupedLocalExperts`) instead of SequentialMLP's loop; the same parameters and results."""
    packed_sequences: bool = False
    """Packed micro-batches (`trainer.pack_sequences`) reach the model: the local spec's attention then applies
    their block mask with the unfused softmax (Megatron's fused causal softmax ignores any mask it is given)."""


def te_available() -> bool:
    """Whether Transformer Engine imports and CUDA is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def make_transformer_config(
    family: ModelFamily, arch: ModelArch, hf_config: dict, ctx: ParallelContext, opts: BuildOptions
):
    """Translate the family's config kwargs into a (MLA)TransformerConfig for this layout, with CPU-safe fusions."""

    kwargs = dict(family.megatron_config_kwargs(arch, hf_config))
    kwargs["activation_func"] = _ACTIVATIONS[kwargs.pop("activation_func")]
    kwargs.pop("multi_latent_attention", None)
    layout = ctx.layout
    dtype = _DTYPES[opts.dtype]
    on_gpu = torch.cuda.is_available()
    if opts.moe_aux_loss_coeff is not None and "moe_aux_loss_coeff" in kwargs:
        kwargs["moe_aux_loss_coeff"] = opts.moe_aux_loss_coeff
    # Megatron's allgather dispatcher refuses variable sequence lengths; the alltoall one (default) allows them.
    kwargs["moe_token_dispatcher_type"] = opts.moe_dispatcher
    if arch.num_experts:
        coeff = kwargs.get("moe_aux_loss_coeff", 0.0)
        kwargs.update(
            moe_grouped_gemm=False,
            moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        )
    kwargs.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # Uneven first/last stages; Megatron's layer_number then carries the global offset that the weight path
        # (trainer/hf_weights.py local_offsets) reads, so loading and gathering need nothing else.
        **layout.megatron_kwargs(),
        sequence_parallel=layout.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not on_gpu,
        perform_initialization=opts.init_weights,
        **fusion_settings(on_gpu, opts),
        variable_seq_lengths=opts.moe_dispatcher == "alltoall",
        deallocate_pipeline_outputs=False,
    )
    if opts.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config_cls = MLATransformerConfig if family.uses_mla() else TransformerConfig
    return config_cls(**kwargs)


FUSED_SOFTMAX_MODULES = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
"""The CUDA extensions (Apex's, not in megatron-core's wheel) Megatron's fused masked softmax imports when a
shape qualifies: without them its first half-precision forward on the local spec fails."""


def fused_softmax_kernels() -> bool:
    """Whether the fused masked softmax's CUDA extensions are installed."""
    return all(importlib.util.find_spec(name) is not None for name in FUSED_SOFTMAX_MODULES)


def fusion_settings(on_gpu: bool, opts: BuildOptions, softmax_kernels: bool | None = None) -> dict:
    """TransformerConfig's fusion switches: the CUDA-only ones on a GPU alone; the masked softmax's only where its
    kernels are installed (`softmax_kernels`, None: look) and not with packed sequences (its causal kernel would
    let them attend across their neighbours)."""
    if softmax_kernels is None:
        softmax_kernels = on_gpu and fused_softmax_kernels()
    return dict(
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=on_gpu and softmax_kernels and not opts.packed_sequences,
        bias_activation_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt_model(
    family: ModelFamily, arch: ModelArch, hf_config: dict, ctx: ParallelContext, opts: BuildOptions | None = None
):
    """Build this rank's GPTModel (its pipeline stage, TP/EP shards) for the given family and checkpoint config."""

    opts = opts or BuildOptions()
    check_layout_fits_model(ctx.layout, arch)
    config = make_transformer_config(family, arch, hf_config, ctx, opts)
    use_te = te_available() if opts.use_te is None else opts.use_te
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    if opts.grouped_experts and not use_te:
        use_grouped_local_experts(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=opts.max_sequence_length,
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    # Packed sequences attend within themselves through TE's `thd` format, or a block mask in the local spec.
    model.packed_attention = "thd" if use_te else "mask"
    if ctx.is_last_stage and opts.logit_temperature != 1.0:
        model.output_layer.register_forward_hook(_divide_logits_by(opts.logit_temperature))
    return model.to(ctx.device)


def _divide_logits_by(temperature: float):
    """A forward hook on the output layer (it returns (logits, bias)) that divides the logits by `temperature`;
    what follows (vocab-parallel cross entropy, the logprobs) then sees the tempered distribution."""

    def hook(module, args, output):
        logits, bias = output
        return logits / temperature, bias

    return hook
