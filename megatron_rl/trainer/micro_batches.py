"""A batch's micro-batches as Megatron's schedule takes them: the plan (`trainer/packing.py`) agreed over data
parallelism, and each micro-batch's model inputs with the function that takes its outputs back to `[b, S, ...]`.

Packed micro-batches attend within each sequence through a block-diagonal causal `attention_mask` (the local
spec's attention applies any mask it is given) or, with Transformer Engine, through `PackedSeqParams` in the
`thd` format. Expert parallelism dispatches tokens per micro-batch, so every data-parallel replica must run the
same number of them: the packed count is the largest any replica needs (one all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.packing import (
    MicroBatching,
    MicroBatchPlan,
    PackedRow,
    as_micro_batching,
    first_fit_decreasing,
    packed_plan,
    padded_plan,
)

PACKED_ATTENTION = "packed_attention"
"""Attribute `build_gpt_model` sets on the model: "thd" (Transformer Engine) or "mask" (local spec)."""


def sequence_lengths(tokens: Tensor, lengths: Tensor | None) -> Tensor:
    """`lengths`, or every row's full width when a batch has none (nothing to pack away)."""
    return lengths if lengths is not None else torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long)


def plan_micro_batches(
    tokens: Tensor, lengths: Tensor | None, micro: int | MicroBatching | MicroBatchPlan, ctx: ParallelContext
) -> MicroBatchPlan:
    """The plan for this replica's `tokens` `[B, S]` (a given plan is returned as it is). Packed: the fewest rows of
    `micro.budget(S)` tokens first-fit decreasing needs, the most over the data-parallel group (every rank calls
    this: an all-reduce), filled evenly."""
    if isinstance(micro, MicroBatchPlan):
        return micro
    micro = as_micro_batching(micro)
    batch, seq = tokens.shape
    if not micro.pack:
        return padded_plan(batch, seq, micro)
    sizes = sequence_lengths(tokens, lengths)
    count = torch.tensor([first_fit_decreasing(sizes.tolist(), micro.budget(seq))], device=ctx.device)
    if ctx.layout.data_parallel > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    return packed_plan(sizes, tokens, int(count.item()), max(ctx.layout.tp, 2))


def _identity(output: Tensor) -> Tensor:
    return output


def packed_model_inputs(row: PackedRow, device: torch.device, model, labels: bool) -> dict:
    """GPTModel inputs of one packed row: tokens, per-sequence positions, the attention within each sequence (a
    mask, or `PackedSeqParams` with Transformer Engine) and, with `labels`, each token's next within its own."""
    inputs = {"input_ids": row.tokens.to(device), "position_ids": row.positions.to(device)}
    if attention_format(model) == "thd":
        cu = row.cu_seqlens().to(device)
        longest = int((cu[1:] - cu[:-1]).max())
        inputs["attention_mask"] = None
        inputs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
    else:
        inputs["attention_mask"] = row.attention_mask().to(device)
    if labels:
        inputs["labels"] = row.labels.to(device)
    return inputs


def unpacker(plan: MicroBatchPlan, index: int) -> Callable[[Tensor], Tensor]:
    """Micro-batch `index`'s outputs `[rows, L, ...]` -> `[b, S, ...]` in the batch layout (identity when padded)."""
    if plan.packed is None:
        return _identity
    return plan.packed[index].unpack_rows


def micro_batch_tokens(plan: MicroBatchPlan, tokens: Tensor, index: int) -> Tensor:
    """Micro-batch `index`'s rows of `tokens` in the batch layout `[b, S]`."""
    return tokens[plan.groups[index]]


def padding_of(plan: MicroBatchPlan, index: int, batch_padding: Tensor) -> Tensor:
    """The MoE routers' padding mask of micro-batch `index` as the model sees it: the packed row's tail, or the
    batch rows' own (`batch_padding` `[B, S]`)."""
    if plan.packed is None:
        return batch_padding[plan.groups[index]]
    return plan.packed[index].padding()


def attention_format(model) -> str:
    """How `model` (through Megatron's DDP and our LoRA wrappers, each holding `.module`) attends within packed
    sequences: "thd" or "mask" (`build_gpt_model` records it)."""
    while not hasattr(model, PACKED_ATTENTION) and hasattr(model, "module"):
        model = model.module
    return getattr(model, PACKED_ATTENTION, "mask")
