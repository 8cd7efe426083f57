"""Load a Hugging Face checkpoint into this rank's Megatron shards, reading only the tensors this rank needs."""

from __future__ import annotations

import torch
from tqdm import tqdm

from megatron_rl.models import ModelArch, ModelFamily, ParamRule, sharding
from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import HFCheckpoint, check_tensor_names, check_weight_dtypes
from megatron_rl.models.naming import canonical_name
from megatron_rl.parallel.groups import ParallelContext

# HF checkpoints of some families carry derived buffers that no model parameter stands for.
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def local_offsets(model, ctx: ParallelContext, arch: ModelArch) -> tuple[int, int]:
    """(global index of this stage's first layer, global index of this EP rank's first expert)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    layer_offset = layers[0].layer_number - 1 if layers is not None and len(layers) else 0
    expert_offset = ctx.ep_rank * (arch.num_experts // ctx.layout.ep) if arch.num_experts else 0
    return layer_offset, expert_offset


def local_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters plus the persistent buffers a checkpoint carries (the router's expert bias); LoRA adapters
    (`X_lora.lora_A` / `lora_B`, which the HF checkpoint does not hold) are left out."""
    tensors = {name: p for name, p in model.named_parameters() if "_lora." not in name}
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            tensors[name] = buf
    return tensors


def uses_te_spec(model) -> bool:
    """Whether the model was built with Transformer Engine layers (their sharding differs in places)."""
    return any(type(m).__name__.startswith("TE") for m in model.modules())


def rule_for(table: dict[str, ParamRule], canonical: str, arch: ModelArch) -> ParamRule:
    """The rule of a canonical name; a tied output layer (last pipeline stage) reuses the embedding's."""
    if canonical in table:
        return table[canonical]
    if canonical == "output_layer.weight" and arch.tie_word_embeddings:
        return table["embedding.word_embeddings.weight"]
    raise CheckpointError(f"Megatron parameter {canonical} has no entry in the {arch.family} parameter map")


def tp_coords(rule: ParamRule, ctx: ParallelContext) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group that splits this parameter: ETP for experts, TP otherwise."""
    if rule.is_expert:
        return ctx.layout.etp, ctx.etp_rank
    return ctx.layout.tp, ctx.tp_rank


def build_local_tensor(ckpt: HFCheckpoint, rule: ParamRule, arch: ModelArch, ctx: ParallelContext) -> torch.Tensor:
    """Read a rule's HF tensors, transform them to the full Megatron tensor, and cut this rank's shard."""
    hf = [ckpt.get(name) for name in rule.hf]
    try:
        full = rule.to_mcore(hf, arch)
        size, rank = tp_coords(rule, ctx)
        return sharding.shard(full, rule, size, rank)
    except (RuntimeError, ValueError) as err:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(rule.hf, hf))
        raise CheckpointError(f"{ckpt.folder}: {shapes} do not fit Megatron {rule.mcore} ({err})") from None


DIRECT_TRANSFORMS = ("copy", "gate_up")
"""Transforms whose full Megatron tensor is just the HF tensors stacked along dim 0 (see `read_direct`)."""


def direct_row_plan(ckpt: HFCheckpoint, rule: ParamRule, target: torch.Tensor, ctx: ParallelContext) -> list | None:
    """[(HF name, its first row, rows)] that stacked give this rank's piece of `rule`, or None if not that simple.

    Simple means: a row-stacking transform, split (if at all) along dim 0 with one tensor-parallel block per HF
    tensor, each HF tensor readable straight from its file in the target's dtype, and the rows adding up to the
    target's shape. Anything else (and every mismatch, whose error message the general path words) is None.
    """
    size, rank = tp_coords(rule, ctx)
    split = rule.tp_dim is not None and size > 1
    if rule.transform not in DIRECT_TRANSFORMS or (split and (rule.tp_dim != 0 or rule.tp_chunks != len(rule.hf))):
        return None
    plan = []
    for name in rule.hf:
        layout = ckpt.layout_of(name)
        if layout is None or layout[1] != target.dtype or not layout[0] or layout[0][1:] != tuple(target.shape[1:]):
            return None
        rows = layout[0][0]
        if split and rows % size:
            return None
        plan.append((name, rank * rows // size, rows // size) if split else (name, 0, rows))
    return plan if sum(rows for _, _, rows in plan) == target.shape[0] else None


def read_direct(ckpt: HFCheckpoint, rule: ParamRule, target: torch.Tensor, ctx: ParallelContext) -> bool:
    """Read this rank's rows of the rule's HF tensors straight into `target`; False (nothing read) if not simple.

    The general path reads whole tensors, builds the full Megatron tensor and cuts the shard: three copies of
    every byte and only part of them kept. Most parameters (expert weights above all) are plain row stacks.
    """
    plan = direct_row_plan(ckpt, rule, target, ctx)
    if plan is None or target.device.type != "cpu" or not target.is_contiguous():  # GPU: the general path
        return False
    row = 0
    for name, first, rows in plan:
        if not ckpt.read_rows_into(name, target.narrow(0, row, rows), first):
            # direct_row_plan checked everything read_rows_into checks; reaching this is a bug, not bad input.
            raise RuntimeError(f"{ckpt.folder}: direct read of {name} refused after it was planned")
        row += rows
    return True


def check_checkpoint_names(ckpt: HFCheckpoint, table: dict[str, ParamRule]) -> None:
    """Raise a CheckpointError naming the tensors the parameter map expects but the checkpoint lacks, or extras,
    or a weight stored in a dtype that would be cast (FP8, integers)."""
    expected = [n for r in table.values() for n in r.hf]
    check_tensor_names(ckpt, expected, IGNORED_HF_SUFFIXES)
    check_weight_dtypes(ckpt, expected)


def load_hf_into_model(
    model, ckpt: HFCheckpoint, family: ModelFamily, arch: ModelArch, ctx: ParallelContext, progress: bool = False
) -> int:
    """Copy every local parameter from the checkpoint; return the number of bytes read.

    Fails with a CheckpointError naming the tensor on a missing/unexpected tensor, a wrong shape or dtype
    mismatch that cannot be cast, before any parameter is half-written where possible.
    """
    table = family.rule_table(arch, te_spec=uses_te_spec(model))
    check_checkpoint_names(ckpt, table)
    layer_offset, expert_offset = local_offsets(model, ctx, arch)
    nbytes = 0
    with torch.no_grad():
        items = list(local_tensors(model).items())
        if progress:
            items = tqdm(items, desc=f"loading {ckpt.folder.name}", unit="tensor")
        for local, target in items:
            rule = rule_for(table, canonical_name(local, layer_offset, expert_offset), arch)
            if read_direct(ckpt, rule, target, ctx):
                nbytes += target.numel() * target.element_size()
                continue
            piece = build_local_tensor(ckpt, rule, arch, ctx)
            if tuple(piece.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{ckpt.folder}: {', '.join(rule.hf)} give shape {tuple(piece.shape)} for Megatron {local} "
                    f"on rank {ctx.rank}, which has shape {tuple(target.shape)}"
                )
            target.copy_(piece)
            nbytes += piece.numel() * piece.element_size()
    return nbytes
