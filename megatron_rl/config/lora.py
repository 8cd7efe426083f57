"""The LoRA section: low-rank adapters on the policy's linear layers, the base frozen (docs/lora.md).

An adapted layer computes `W0 x + (alpha / rank) B A x` with `A` [rank, in] and `B` [out, rank]; `B` starts at
zero, so the adapted model starts equal to the base. Only the adapters train and (`sync`) travel to the engines.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.base import Section

LoraTarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "expert_fc1", "expert_fc2"]
"""Megatron module names of the layers an adapter can sit on (Megatron-Bridge's spelling; HF names in the docs)."""

LORA_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "expert_fc1", "expert_fc2")
"""Every target, in the order the model lists them."""
EXPERT_TARGETS: tuple[str, ...] = ("expert_fc1", "expert_fc2")
"""The targets on routed experts (one adapter pair per expert)."""
HF_TARGET_NAMES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "expert_fc1": ("experts.*.gate_proj", "experts.*.up_proj"),
    "expert_fc2": ("experts.*.down_proj",),
}
"""The Hugging Face / peft module names each target covers (what `lora_target_modules` would name)."""
_PEFT_ALIASES = {name: target for target, names in HF_TARGET_NAMES.items() for name in names if "*" not in name}


class LoraConfig(Section):
    """Low-rank adapters (LoRA) on the policy: the base weights frozen, only the adapters trained and synced."""

    rank: int = Field(0, ge=0, le=1024)
    """Adapter rank r; 0 switches LoRA off (full fine-tuning)."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank (peft's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on an adapter's input in training forwards (peft's `lora_dropout`); the logprob passes (proximal,
    reference, evaluation) run without it. 0 keeps the training forward equal to the engines' computation."""
    targets: tuple[LoraTarget, ...] = LORA_TARGETS
    """Layers that get adapters, in Megatron's names: `linear_qkv` (HF q/k/v_proj, one shared A, B over the fused
    q|k|v output), `linear_proj` (o_proj), `linear_fc1` / `linear_fc2` (dense and shared-expert MLPs: gate/up_proj,
    down_proj), `expert_fc1` / `expert_fc2` (every routed expert's gate/up_proj and down_proj, one pair each)."""
    sync: Literal["merge", "vllm"] = "merge"
    """How the engines apply synced adapters: `merge` (each engine keeps W0 and loads W0 + alpha/r B A in place:
    every target, experts included, full inference speed) or `vllm` (a vLLM LoRA adapter: dense targets only, as
    vLLM's fused MoE kernels take no LoRA on CPU; an engine on a model with routed experts refuses to start)."""

    @property
    def enabled(self) -> bool:
        """Whether the run trains adapters instead of the whole model."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on B A x (0 when LoRA is off)."""
        return self.alpha / self.rank if self.rank else 0.0

    @field_validator("targets", mode="before")
    @classmethod
    def _known_targets(cls, value):
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            return value
        out = []
        for name in value:
            if name in _PEFT_ALIASES:
                raise ValueError(
                    f"{name!r} is a Hugging Face module name: name the Megatron layer {_PEFT_ALIASES[name]!r}, which"
                    f" covers {', '.join(HF_TARGET_NAMES[_PEFT_ALIASES[name]])} (allowed: {', '.join(LORA_TARGETS)})"
                )
            if name not in out:
                out.append(name)
        return tuple(out)

    @model_validator(mode="after")
    def _targets_fit_sync(self) -> LoraConfig:
        if not self.targets:
            raise ValueError(f"lora.targets is empty: name at least one of {', '.join(LORA_TARGETS)}")
        experts = [t for t in self.targets if t in EXPERT_TARGETS]
        if self.sync == "vllm" and experts:
            raise ValueError(
                f"lora.sync=vllm applies adapters as a vLLM LoRA adapter, which vLLM's fused MoE experts do not take"
                f" (its CPU expert kernel has no LoRA), but lora.targets has {', '.join(experts)}: use lora.sync=merge"
                f" (merges W0 + alpha/r B A into the engines' weights, experts included) or drop the expert targets"
            )
        return self

    def has(self, target: str) -> bool:
        """Whether adapters go on `target` (with LoRA on)."""
        return self.enabled and target in self.targets
