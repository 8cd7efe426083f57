"""The trainer's LoRA adapters as a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) that
peft loads onto the base Hugging Face checkpoint (`PeftModel.from_pretrained(base, folder)`).

Attention and dense-MLP adapters keep their peft names (`base_model.model.` + `model.layers.0.self_attn.q_proj.
lora_A.weight`; q/k/v and gate/up each with the fused layer's shared A and its own rows of B). Transformers 5 holds
a layer's routed experts as 3-D parameters (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj`
[E, H, F]), so expert adapters go in peft's `target_parameters` form (peft 0.21 `lora.ParamWrapper`): one
`lora_A` [E * r, in] (expert e's A in rows e*r..(e+1)*r) and one `lora_B` [out, r * E] (expert e's B in the columns
k*E + e), and for gate_up the expert's gate and up rows of B stacked under their shared A (rank r, exact). Two
targeted parameters of one module nest: the first listed is the inner one (`experts.base_layer.lora_A.weight`).

Families: Qwen3-MoE (`experts.{e}.gate_proj / up_proj / down_proj`) and the dense ones; dense-MLP targets on a
model with routed experts are refused (peft 0.21 maps `gate_proj` / `up_proj` / `down_proj` in `target_modules`
onto the experts of a transformers-5 MoE model).
"""

from __future__ import annotations

import collections
import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_rl.config import LoraConfig
from megatron_rl.errors import UserError
from megatron_rl.models import ModelArch, ModelFamily
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.lora import iter_adapter_tensors

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""peft's prefix of every adapter tensor's name in `adapter_model.safetensors`."""
PEFT_EXPORT_DIR = "adapter"
"""Where a LoRA run writes its PEFT adapter, beside the merged HF export (`RUN_DIR/adapter`, `step_N/adapter`)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_EXPERT = re.compile(
    r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.lora_(?P<which>[AB])\.weight$"
)
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""transformers 5's expert parameters, in the order they are listed in `target_parameters`."""
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


class PeftExportError(UserError, ValueError):
    """Adapters that cannot be written in peft's form; names the tensor, target or family."""


def _expert_factors(parts: dict, param: str, experts: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One 3-D expert parameter's (lora_A [E*r, in], lora_B [out, r*E]) from the per-expert HF adapters."""
    a_list, b_list = [], []
    for e in range(experts):
        try:
            if param == "gate_up_proj":
                a = parts[("gate_proj", "A", e)]
                b = torch.cat([parts[("gate_proj", "B", e)], parts[("up_proj", "B", e)]], dim=0)
            else:
                a, b = parts[("down_proj", "A", e)], parts[("down_proj", "B", e)]
        except KeyError as err:
            proj, which, _ = err.args[0]
            raise PeftExportError(
                f"{where}: expert {e} has no {proj}.lora_{which} (every expert needs its adapter)"
            ) from None
        a_list.append(a)
        b_list.append(b)
    a = torch.cat(a_list, dim=0)
    b = torch.stack(b_list, dim=2)  # [out, r, E]: column k*E + e is expert e's column k
    return a.contiguous(), b.reshape(b.shape[0], -1).contiguous()


def peft_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's adapter tensors (names with `PEFT_PREFIX`) from the HF-named ones of `iter_adapter_tensors`: the
    non-expert ones as they are, each MoE layer's per-expert ones stacked into its 3-D parameters' form."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict] = collections.defaultdict(dict)
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            out[PEFT_PREFIX + name] = tensor.clone().contiguous()  # q/k/v share one A: separate copies
        else:
            experts[match["module"]][(match["proj"], match["which"], int(match["expert"]))] = tensor
    for module, parts in sorted(experts.items()):
        count = 1 + max(e for _, _, e in parts)
        targeted = [p for p in _EXPERT_PARAMS if any(_owns(p, proj) for proj, _, _ in parts)]
        for i, param in enumerate(targeted):
            a, b = _expert_factors(parts, param, count, f"{module}.{param}")
            prefix = f"{PEFT_PREFIX}{module}." + "base_layer." * (len(targeted) - 1 - i)
            out[prefix + "lora_A.weight"], out[prefix + "lora_B.weight"] = a, b
    return out


def _owns(param: str, proj: str) -> bool:
    return proj == "down_proj" if param == "down_proj" else proj in ("gate_proj", "up_proj")


def adapter_config(lora: LoraConfig, tensors: dict[str, torch.Tensor], base: str, has_experts: bool) -> dict:
    """`adapter_config.json`: rank, alpha, dropout, the HF modules (`target_modules`) and the experts' 3-D
    parameters (`target_parameters`) the adapters sit on; PeftExportError for dense-MLP adapters on a model with
    routed experts (see module doc)."""
    modules, params = set(), set()
    for name in tensors:
        match = _EXPERT.match(name)
        if match is not None:
            params.add("mlp.experts.gate_up_proj" if match["proj"] != "down_proj" else "mlp.experts.down_proj")
        else:
            modules.add(name.rsplit(".", 3)[-3])  # `<...>.<module>.lora_A.weight`
    dense_mlp = sorted(modules & set(_DENSE_MLP))
    if dense_mlp and has_experts:
        raise PeftExportError(
            f"lora.targets put adapters on the dense MLP ({', '.join(dense_mlp)}) of a model with routed experts: peft"
            f" 0.21 maps those names onto the experts of a transformers-5 MoE model, so the adapter would not load as"
            f" trained; export without linear_fc1 / linear_fc2, or use the merged export"
        )
    ordered = [f"mlp.experts.{param}" for param in _EXPERT_PARAMS if f"mlp.experts.{param}" in params]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "target_modules": sorted(modules), "target_parameters": ordered,
    }  # fmt: skip


def export_peft_adapter(
    model, family: ModelFamily, arch: ModelArch, ctx: ParallelContext, lora: LoraConfig, out: str | Path, base: str
) -> dict:
    """(Every rank) write the model's adapters as a PEFT adapter folder `out` (rank 0 writes; the tensors, small,
    are gathered there); `base` is the base checkpoint the adapter goes on. Returns counts and bytes."""
    if arch.num_experts and family.name != "qwen3_moe" and any(t.startswith("expert_") for t in lora.targets):
        raise PeftExportError(
            f"a PEFT export of expert adapters is built for Qwen3-MoE's expert names only, not {family.name}'s"
        )
    mine = {name: tensor.detach().cpu().clone() for name, tensor in iter_adapter_tensors(model, arch, ctx)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tensors = {name: t for part in everyone for name, t in part.items()}
    # On every rank (each holds every tensor now), so that a refused adapter fails every rank alike.
    config = adapter_config(lora, tensors, str(base), bool(arch.num_experts))
    weights = peft_tensors(tensors)
    report = {"tensors": len(weights), "bytes": sum(t.numel() * t.element_size() for t in weights.values())}
    if ctx.rank == 0:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    dist.barrier()
    return report


def export_lora_adapter(model, rank, cfg, out: str | Path) -> dict:
    """(Every rank) a LoRA run's adapters as a PEFT folder `out` on the base `cfg.model.hf_path` (`rank`: the
    trainer rank's family, arch and ctx); adapters peft cannot take as trained are logged and skipped (every rank
    alike), since the run's merged export holds them anyway."""
    try:
        return export_peft_adapter(model, rank.family, rank.arch, rank.ctx, cfg.lora, out, cfg.model.hf_path)
    except PeftExportError as err:
        log.warning("no PEFT adapter export: %s", err)
        return {}
