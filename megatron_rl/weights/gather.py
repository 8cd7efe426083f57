"""Yield full, HF-named tensors from this rank's Megatron shards.

Tensor-parallel shards are all-gathered inside their TP group (ETP group for experts); each full tensor is then
yielded by exactly one owner rank: for dense parameters the rank with tp_rank 0 and dp_rank 0 of its pipeline
stage, for expert parameters the rank with etp_rank 0 and expert-data-parallel rank 0 of the EP rank that holds
the expert. So every pipeline stage and every expert-parallel rank sends its own tensors, and nothing is sent
twice. Every rank must iterate (the all-gathers are collectives), owners or not.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.models import ModelArch, ModelFamily, ParamRule, sharding
from megatron_rl.models.naming import canonical_name
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.hf_weights import local_offsets, local_tensors, rule_for, tp_coords, uses_te_spec
from megatron_rl.trainer.lora import adapted_weights, merged_weight


def expert_data_parallel_rank(ctx: ParallelContext) -> int:
    """This rank's index among the replicas of its experts."""

    return ps.get_expert_data_parallel_rank()


def is_owner(rule: ParamRule, ctx: ParallelContext) -> bool:
    """Whether this rank yields the full tensor of `rule` (see module docstring)."""
    if rule.is_expert:
        return ctx.etp_rank == 0 and expert_data_parallel_rank(ctx) == 0
    return ctx.tp_rank == 0 and ctx.dp_rank == 0


def gather_full(tensor: torch.Tensor, rule: ParamRule, ctx: ParallelContext) -> torch.Tensor:
    """All-gather a parameter's TP (or ETP) shards and put the full Megatron tensor together."""
    size, _ = tp_coords(rule, ctx)
    if rule.tp_dim is None or size == 1:
        return tensor.detach()
    group = ctx.etp_group if rule.is_expert else ctx.tp_group
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    return sharding.unshard(shards, rule)


def iter_hf_tensors(
    model,
    family: ModelFamily,
    arch: ModelArch,
    ctx: ParallelContext,
    experts: bool | None = None,
    merge_lora: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor this rank owns; `experts` True/False restricts to one pass.

    A tied output layer is skipped (its HF tensor is the embedding's). LoRA adapters are never yielded (the HF
    checkpoint has no place for them); `merge_lora` yields each adapted weight as `W0 + alpha/r B A` instead of
    its base `W0` (a merged export: each shard merged with its own adapter shards, then gathered).
    """
    table = family.rule_table(arch, te_spec=uses_te_spec(model))
    layer_offset, expert_offset = local_offsets(model, ctx, arch)
    adapters = adapted_weights(model) if merge_lora else {}
    for local, tensor in local_tensors(model).items():
        if local in adapters:
            tensor = merged_weight(adapters[local], tensor)
        canonical = canonical_name(local, layer_offset, expert_offset)
        if canonical == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        rule = rule_for(table, canonical, arch)
        if experts is not None and rule.is_expert != experts:
            continue
        full = gather_full(tensor, rule, ctx)
        if is_owner(rule, ctx):
            yield from zip(rule.hf, rule.to_hf(full, arch))
