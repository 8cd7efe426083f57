"""Model families: Hugging Face config -> Megatron config, and the Megatron <-> HF parameter map."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.models.base import AttentionParams, CheckpointError, ModelArch, ModelFamily, ParamRule
from megatron_rl.models.deepseek_v3 import DeepseekV3Family
from megatron_rl.models.mixtral import MixtralFamily
from megatron_rl.models.qwen3 import Qwen3Family
from megatron_rl.models.qwen3_moe import Qwen3MoeFamily

FAMILIES: dict[str, ModelFamily] = {
    f.name: f for f in (Qwen3MoeFamily(), MixtralFamily(), DeepseekV3Family(), Qwen3Family())
}
"""Every supported family by its command-line name."""

__all__ = [
    "FAMILIES",
    "AttentionParams",
    "CheckpointError",
    "ModelArch",
    "ModelFamily",
    "ParamRule",
    "get_family",
    "family_for_hf_config",
    "read_hf_config",
]


def get_family(name: str) -> ModelFamily:
    """The family called `name`, or a ValueError that lists the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family '{name}'; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def family_for_hf_config(hf_config: dict, where: str = "config.json") -> ModelFamily:
    """Recognise a family from a HF config's `architectures` (first) or `model_type`."""
    for arch_name in hf_config.get("architectures") or []:
        for family in FAMILIES.values():
            if arch_name in family.hf_architectures:
                return family
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise CheckpointError(
        f"{where}: unknown architecture {hf_config.get('architectures')} / model_type '{model_type}'; "
        f"supported: {', '.join(known)}"
    )


def read_hf_config(hf_dir: str | Path) -> dict:
    """Read `config.json` of a HF checkpoint folder with an error that names the file."""
    path = Path(hf_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the checkpoint folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable config.json ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    return config
