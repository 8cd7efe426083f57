"""A batch's micro-batches as Megatron's schedule takes them: the plan (`trainer/packing.py`) agreed over data
parallelism, and each micro-batch's model inputs with the function that takes its outputs back to `[b, S, ...]`.

Packed micro-batches attend within each sequence through a block-diagonal causal `attention_mask` (the local
spec's attention applies any mask it is given) or, with Transformer Engine, through `PackedSeqParams` in the
`thd` format. Expert parallelism dispatches tokens per micro-batch, so every data-parallel replica must run the
same number of them: the packed count is the largest any replica needs (one all-reduce); with the `allgather`
dispatcher (`MicroBatching.uniform`) they also hold as many rows each.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.optimizer import unwrap_model
from megatron_rl.trainer.packing import (
    MicroBatching,
    MicroBatchPlan,
    PackedRows,
    as_micro_batching,
    packed_plan,
    packed_rows_needed,
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
    """The plan for this replica's `tokens` `[B, S]` (a given plan is returned as it is). Packed: the sequences in
    rows of S tokens, at most `micro.budget(S) // S` rows per micro-batch; as many micro-batches as the replica of
    the data-parallel group that needs the most, and with `micro.uniform` as many rows in each on every replica
    (every rank calls this: an all-reduce)."""
    if isinstance(micro, MicroBatchPlan):
        return micro
    micro = as_micro_batching(micro)
    batch, seq = tokens.shape
    if not micro.pack:
        return padded_plan(batch, seq, micro)
    sizes = sequence_lengths(tokens, lengths)
    per_micro_batch = max(1, micro.budget(seq) // seq)  # rows of `seq` tokens
    rows = packed_rows_needed(sizes.tolist(), seq)
    agreed = torch.tensor([math.ceil(rows / per_micro_batch), rows], device=ctx.device)
    if ctx.layout.data_parallel > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    count, most_rows = (int(x) for x in agreed.tolist())
    # The replica with the most rows needs the fewest per micro-batch that hold them; every other one fits too.
    per = math.ceil(most_rows / count) if micro.uniform else None
    return packed_plan(sizes, tokens, count, seq, rows=per)


def packed_model_inputs(packed: PackedRows, device: torch.device, model, labels: bool) -> dict:
    """GPTModel inputs of one micro-batch's packed rows: tokens, per-sequence positions, the attention within each
    sequence (a mask per row; with Transformer Engine the rows laid end to end as one `thd` row with
    `PackedSeqParams`) and, with `labels`, each token's next within its own sequence."""
    thd = attention_format(model) == "thd"

    def shaped(t: Tensor) -> Tensor:
        return (t.reshape(1, -1) if thd else t).to(device)

    inputs = {"input_ids": shaped(packed.tokens), "position_ids": shaped(packed.positions)}
    if thd:
        cu = packed.cu_seqlens().to(device)
        longest = int((cu[1:] - cu[:-1]).max())
        inputs["attention_mask"] = None
        inputs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
    else:
        if getattr(getattr(unwrap_model(model), "config", None), "masked_softmax_fusion", False):
            raise ValueError(
                "packed sequences reach a model built with the fused masked softmax, whose causal kernel ignores"
                " their block mask: build it with BuildOptions(packed_sequences=True)"
            )
        inputs["attention_mask"] = packed.attention_mask().to(device)
    if labels:
        inputs["labels"] = shaped(packed.labels)
    return inputs


def schedule_shape(plan: MicroBatchPlan, model) -> tuple[int, int]:
    """(seq_length, micro_batch_size) of every micro-batch as Megatron's schedule is told them (pipeline stages
    exchange activations of that shape): packed rows in the `thd` format are one row of them all."""
    if plan.packed is not None and attention_format(model) == "thd":
        return plan.seq_length * plan.rows, 1
    return plan.seq_length, plan.rows_per_micro_batch


def as_scheduled(per_token: Tensor, plan: MicroBatchPlan, model) -> Tensor:
    """`plan.routes`' per-token tensors (`[n * rows, L, ...]`, micro-batch after micro-batch) in the rows the model
    sees: in the `thd` format each micro-batch's packed rows are one row laid end to end, so its router order is
    row after row, not position after position across rows as `[rows, L]` would be read (`schedule_shape`)."""
    seq, _ = schedule_shape(plan, model)
    return per_token.reshape(-1, seq, *per_token.shape[2:])


@dataclasses.dataclass(frozen=True)
class LossLayout:
    """Where one micro-batch's per-token results are computed: on the rows the model ran (packed: the packed rows,
    so that its vocabulary-wide logits are never unpacked to the larger `[b, S, V]`), then taken back to the
    batch layout `[b, S, ...]` that every mask and stat keeps."""

    packed: PackedRows | None = None
    """The micro-batch's packed rows; None when padded (every method is then the identity)."""

    def rows(self, output: Tensor) -> Tensor:
        """The model's output as `[rows, L, ...]` (the `thd` format's one row split back into the packed rows)."""
        if self.packed is None:
            return output
        return output.reshape(*self.packed.shape, *output.shape[2:])

    def labels(self, batch_labels: Tensor) -> Tensor:
        """Each position's next token on the model's rows: `batch_labels` `[b, S]`, or the packed rows' own."""
        return batch_labels if self.packed is None else self.packed.labels.to(batch_labels.device)

    def per_position(self, values: Tensor | None, fill) -> Tensor | None:
        """This micro-batch's `[b, S or S-1, ...]` on the model's rows (packed: `[r, C, ...]`, `fill` elsewhere)."""
        if values is None or self.packed is None:
            return values
        return self.packed.pack(values, fill, local=True)

    def back(self, per_token: Tensor) -> Tensor:
        """Per-token results on the model's rows -> `[b, S, ...]` in the batch layout (with gradient)."""
        return per_token if self.packed is None else self.packed.unpack_rows(per_token)


def loss_layout(plan: MicroBatchPlan, index: int) -> LossLayout:
    """Micro-batch `index`'s `LossLayout`."""
    return LossLayout(None if plan.packed is None else plan.packed[index])


def micro_batch_tokens(plan: MicroBatchPlan, tokens: Tensor, index: int) -> Tensor:
    """Micro-batch `index`'s rows of `tokens` in the batch layout `[b, S]`."""
    return tokens[plan.groups[index]]


def padding_of(plan: MicroBatchPlan, index: int, batch_padding: Tensor, model) -> Tensor:
    """The MoE routers' padding mask of micro-batch `index` as the model sees it: the packed rows' tails (laid
    end to end in the `thd` format), or the batch rows' own (`batch_padding` `[B, S]`)."""
    if plan.packed is None:
        return batch_padding[plan.groups[index]]
    padding = plan.packed[index].padding()
    return padding.reshape(1, -1) if attention_format(model) == "thd" else padding


def attention_format(model) -> str:
    """How `model` attends within packed sequences: "thd" or "mask" (`build_gpt_model` records it)."""
    return getattr(unwrap_model(model), PACKED_ATTENTION, "mask")
