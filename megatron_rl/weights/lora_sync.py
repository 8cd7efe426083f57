"""Adapter-only weight sync (`lora.sync: merge` and `vllm`), trainer side: what the plan is made from and what is sent.

With LoRA the base weights never change, and every engine starts from the base HF checkpoint, which is `W0`. So
an update carries only the adapters, under peft's names (`model.layers.0.self_attn.q_proj.lora_A.weight`: a fused
q/k/v or gate/up layer's shared A once per HF module, B split into the modules' rows; experts per expert), each
full tensor from exactly one owner rank (`trainer.lora.iter_adapter_tensors`). The engines merge
`W0 + scale * B A` from a kept copy of `W0` and load the merged HF weights in place
(`weights/engine/lora_merge.py`), or with `lora.sync: vllm` serve them as a vLLM LoRA adapter
(`weights/engine/lora_adapter.py`, `rollout/engine_lora.py`); the plan's JSON tells them the scale
(`plan.lora_plan_to_json`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_rl.config import LoraConfig
from megatron_rl.errors import UserError
from megatron_rl.models import ModelArch
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.lora import iter_adapter_tensors, lora_adapters, owned_adapter_shapes
from megatron_rl.weights.plan import TensorSpec


class LoraSyncError(UserError, RuntimeError):
    """An adapter-only sync that cannot be made: a model without adapters."""


def owned_adapter_specs(model, arch: ModelArch, ctx: ParallelContext) -> list[TensorSpec]:
    """The adapter tensors this rank sends, as the plan sees them (shapes only, in the order they are yielded;
    an expert's carry its layer and expert, so they go only to the engine workers hosting that expert)."""
    specs = []
    for name, shape, dtype, rule in owned_adapter_shapes(model, arch, ctx):
        where = (rule.layer, rule.expert) if rule.is_expert else (None, None)
        specs.append(TensorSpec(name, shape, dtype, ctx.rank, rule.is_expert, *where))
    return specs


def gather_adapter_specs(model, arch: ModelArch, ctx: ParallelContext) -> list[TensorSpec]:
    """Every rank's `owned_adapter_specs`, in rank order, on every rank (a collective over the default group);
    LoraSyncError when the model holds no adapter (LoRA off, or adapters not added before the sync)."""
    if not lora_adapters(model):
        raise LoraSyncError(f"rank {ctx.rank}: an adapter-only weight sync, but the model holds no LoRA adapter")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, owned_adapter_specs(model, arch, ctx))
    return list(itertools.chain.from_iterable(everyone))


def adapter_tensors(model, arch: ModelArch, ctx: ParallelContext) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) of this rank's adapter tensors, for `sender.send_update` (every rank iterates)."""
    yield from iter_adapter_tensors(model, arch, ctx)


def adapter_bytes(specs: list[TensorSpec]) -> int:
    """Bytes of the adapter tensors themselves (what an adapter-only sync must carry, headers aside)."""
    return sum(spec.nbytes for spec in specs)


def merge_scale(lora: LoraConfig) -> float | None:
    """The scale of an adapter-only sync (alpha / rank), or None for a full sync (LoRA off). Both engine modes
    take it: `merge` merges W0 + scale B A, `vllm` writes it into the PEFT folder's `lora_alpha` (scale * r)."""
    if not lora.enabled:
        return None
    return lora.scale
