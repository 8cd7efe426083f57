"""The policy model section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Section


class ModelConfig(Section):
    """Which model to train and in what precision."""

    hf_path: str = ""
    """Folder of a Hugging Face checkpoint (config.json + safetensors); its family is recognised from config.json."""
    family: Literal["qwen3_moe", "mixtral", "deepseek_v3", "qwen3"] | None = None
    """The family of the tiny model `make_tiny` makes; with a checkpoint, the family its config.json must hold
    (the trainer and the engines go by config.json: a mismatch is refused at start-up)."""
    make_tiny: bool = False
    """When hf_path holds no config.json, make a small random checkpoint of `family` there (`megatron-rl
    make-tiny`) instead of failing: for the quickstart, tests and demos, never for a real model."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype of trainer and engines (float32 for exact CPU parity tests)."""
    max_sequence_length: int = Field(4096, ge=16)
    """Longest prompt + response the trainer prepares rotary embeddings for."""
    hf_config: str = ""
    """config.json used for planning (`megatron-rl plan`) when hf_path is not downloaded yet (for example one of
    configs/models/); empty: hf_path/config.json."""

    @model_validator(mode="after")
    def _tiny_needs_family(self) -> ModelConfig:
        if self.make_tiny and not self.family:
            raise ValueError("model.make_tiny=true needs model.family (which family of tiny model to make)")
        return self
