"""How a batch's sequences are cut into micro-batches: by count, by tokens, or packed end to end without padding.

Pure logic (no process groups): the plan of which rows go together, and for packed micro-batches the packed row's
tokens, positions, labels, segment mask and the index that takes its outputs back to the batch's `[b, S]` layout.

Packing (`MicroBatching.pack`): each micro-batch is one row holding whole sequences back to back (rows sorted
longest first and spread over the fewest micro-batches that keep each within `MicroBatching.tokens`), padded
only at its tail to the step's common length. Attention stays inside each sequence (a block-diagonal causal mask,
or Transformer Engine's `thd` format with cumulative sequence lengths). The rotary embedding turns a position
shift into a phase that cancels in every query-key product, so a sequence computes what it computes alone at
row start. The losses run on the outputs unpacked to `[b, S]`, so everything per position (masks, old logprobs,
routes, kept sets) keeps the batch's layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_rl.config import TrainerConfig


@dataclasses.dataclass(frozen=True)
class MicroBatching:
    """The trainer's micro-batch settings (`trainer.micro_batch_size`, `micro_batch_tokens`, `pack_sequences`)."""

    size: int = 1
    """Sequences per micro-batch when `tokens` is 0 and nothing is packed."""
    tokens: int = 0
    """Tokens per micro-batch (padded tokens when not packing); 0 uses `size` sequences."""
    pack: bool = False
    """Pack whole sequences end to end into one row per micro-batch, no padding between them."""

    @classmethod
    def of(cls, trainer: TrainerConfig) -> MicroBatching:
        """The settings of the `trainer` config section."""
        return cls(size=trainer.micro_batch_size, tokens=trainer.micro_batch_tokens, pack=trainer.pack_sequences)

    def budget(self, seq: int) -> int:
        """The tokens one micro-batch may hold for a batch padded to `seq`."""
        return self.tokens if self.tokens > 0 else self.size * seq


def as_micro_batching(value: int | MicroBatching) -> MicroBatching:
    """`value` as `MicroBatching` (an int is a micro-batch size)."""
    return value if isinstance(value, MicroBatching) else MicroBatching(size=int(value))


def padded_group_size(batch_size: int, seq: int, micro: MicroBatching) -> int:
    """Sequences per padded micro-batch: `micro.size`, or with a token budget the largest divisor of `batch_size`
    whose micro-batch holds at most that many padded tokens (at least one sequence)."""
    if micro.tokens <= 0:
        if batch_size % micro.size:
            raise ValueError(
                f"a batch of {batch_size} sequences is not divisible by trainer.micro_batch_size={micro.size}"
            )
        return micro.size
    cap = max(1, min(batch_size, micro.tokens // seq))
    return max(d for d in range(1, cap + 1) if batch_size % d == 0)


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> int:
    """How many bins of `budget` tokens first-fit decreasing needs for sequences of `lengths` (one longer than
    the budget gets a bin of its own)."""
    free: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, room in enumerate(free):
            if n <= room:
                free[i] -= n
                break
        else:
            free.append(max(0, budget - n))
    return len(free)


def balanced_bins(lengths: Sequence[int], count: int) -> list[list[int]]:
    """The indices of `lengths` spread over exactly `count` bins, longest first into the least-filled bin (ties:
    the first); each bin's indices ascending. With fewer sequences than bins the rest stay empty."""
    bins: list[list[int]] = [[] for _ in range(count)]
    fill = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(count), key=lambda b: (fill[b], b))
        bins[target].append(i)
        fill[target] += lengths[i]
    return [sorted(b) for b in bins]


@dataclasses.dataclass
class PackedRow:
    """One micro-batch's sequences packed end to end into one row `[1, L]`, and the way back to `[b, S]`."""

    rows: Tensor
    """`[b]` int64 the batch rows it holds, in packing order."""
    tokens: Tensor
    """`[1, L]` int64 their tokens back to back, then padding."""
    positions: Tensor
    """`[1, L]` int64 each token's position within its own sequence (padding counts on from 0)."""
    labels: Tensor
    """`[1, L]` int64 the next token of the same sequence (0 at each sequence's last token and in the padding)."""
    segments: Tensor
    """`[1, L]` int64 which of `rows` each token belongs to; the padding is segment b."""
    unpack: Tensor
    """`[b, S]` int64 the packed position of each (row, t) of the batch layout (0 past a sequence's length)."""
    lengths: Tensor
    """`[b]` int64 the sequences' lengths."""

    @property
    def length(self) -> int:
        """L, the packed row's length."""
        return int(self.tokens.shape[1])

    def padding(self) -> Tensor:
        """`[1, L]` bool, True at the tail padding (the MoE routers leave it out)."""
        return self.segments == len(self.rows)

    def attention_mask(self) -> Tensor:
        """`[1, 1, L, L]` bool, True where a query may not attend: another segment, or a later position."""
        seg = self.segments[0]
        causal = torch.ones(self.length, self.length, dtype=torch.bool).tril()
        return ~((seg[:, None] == seg[None, :]) & causal)[None, None]

    def cu_seqlens(self) -> Tensor:
        """`[b + 2]` int32 cumulative lengths of the segments, the padding the last (Transformer Engine `thd`)."""
        sizes = torch.cat([self.lengths, torch.tensor([self.length - int(self.lengths.sum())])])
        return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32)

    def pack(self, per_position: Tensor, fill) -> Tensor:
        """A batch-layout tensor `[B, S, ...]` (the whole batch's) -> this row's `[1, L, ...]`, `fill` in padding."""
        out = torch.full((self.length, *per_position.shape[2:]), fill, dtype=per_position.dtype)
        for i, (row, n) in enumerate(zip(self.rows.tolist(), self.lengths.tolist())):
            start = int(self.lengths[:i].sum())
            out[start : start + n] = per_position[row, :n]
        return out[None]

    def unpack_rows(self, packed: Tensor) -> Tensor:
        """This row's outputs `[1, L, ...]` -> `[b, S, ...]` in the batch layout (with gradient); positions past a
        sequence's length hold the row's first output (never trained on: every mask is 0 there)."""
        index = self.unpack.to(packed.device)
        flat = packed[0].index_select(0, index.reshape(-1))
        return flat.reshape(*index.shape, *packed.shape[2:])


def pack_rows(tokens: Tensor, lengths: Tensor, rows: Sequence[int], length: int, pad_id: int = 0) -> PackedRow:
    """The batch rows `rows` of `tokens` `[B, S]` (each `lengths[row]` real tokens) packed into one row of
    `length` tokens (ValueError when they do not fit)."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    sizes = lengths[index].long()
    total = int(sizes.sum())
    if total > length:
        raise ValueError(f"packing: {total} tokens do not fit a row of {length}")
    seq = tokens.shape[1]
    packed = torch.full((length,), pad_id, dtype=tokens.dtype)
    positions = torch.zeros(length, dtype=torch.long)
    labels = torch.zeros(length, dtype=torch.long)
    segments = torch.full((length,), len(index), dtype=torch.long)
    unpack = torch.zeros(len(index), seq, dtype=torch.long)
    start = 0
    for i, (row, n) in enumerate(zip(index.tolist(), sizes.tolist())):
        packed[start : start + n] = tokens[row, :n]
        positions[start : start + n] = torch.arange(n)
        labels[start : start + n - 1] = tokens[row, 1:n]
        segments[start : start + n] = i
        unpack[i, :n] = torch.arange(start, start + n)
        start += n
    positions[start:] = torch.arange(length - start)
    return PackedRow(
        rows=index, tokens=packed[None], positions=positions[None], labels=labels[None], segments=segments[None],
        unpack=unpack, lengths=sizes,
    )  # fmt: skip


@dataclasses.dataclass
class MicroBatchPlan:
    """Which batch rows each micro-batch holds (and, packed, how); every rank of a replica holds the same plan."""

    groups: list[Tensor]
    """Per micro-batch, `[b_i]` int64 batch rows (consecutive equal slices when padded)."""
    seq_length: int
    """The length every micro-batch's rows have: the batch's S, or the packed rows' common L."""
    packed: list[PackedRow] | None = None
    """Per micro-batch its packed row; None: padded micro-batches (`tokens[group]`)."""

    @property
    def num_micro_batches(self) -> int:
        """How many micro-batches."""
        return len(self.groups)

    @property
    def rows_per_micro_batch(self) -> int:
        """The micro-batch size Megatron's schedule is told (1 when packed: one row each)."""
        return 1 if self.packed is not None else int(self.groups[0].numel())

    def order(self) -> Tensor:
        """`[B]` the batch rows in micro-batch order (what concatenated per-micro-batch outputs are in)."""
        return torch.cat(self.groups)

    def restore(self, parts: Sequence[Tensor], dim: int = 0) -> Tensor:
        """Per-micro-batch outputs (each `[b_i, ...]` along `dim`) -> `[B, ...]` in the batch's row order."""
        joined = torch.cat(list(parts), dim=dim)
        inverse = torch.empty_like(self.order())
        inverse[self.order()] = torch.arange(len(inverse))
        return joined.index_select(dim, inverse.to(joined.device))

    def routes(self, routes: Tensor, free: Tensor) -> tuple[Tensor, Tensor]:
        """The batch's `[B, S, L, k]` routes and `[B, S]` free mask in micro-batch layout: `[n, L_packed, ...]`
        (one packed row each, padding free) or the rows in `order()`."""
        if self.packed is None:
            order = self.order()
            return routes[order], free[order]
        packed = torch.cat([p.pack(routes, 0) for p in self.packed])
        return packed, torch.cat([p.pack(free, True) for p in self.packed])


def packed_plan(lengths: Tensor, tokens: Tensor, count: int, multiple: int, pad_id: int = 0) -> MicroBatchPlan:
    """The batch's sequences (`lengths` of `tokens` `[B, S]`) packed into `count` rows of one common length (the
    fullest row's, rounded up to a multiple of `multiple`: tensor parallelism splits it)."""
    sizes = lengths.tolist()
    bins = balanced_bins(sizes, count)
    fullest = max(sum(sizes[i] for i in b) for b in bins)
    length = max(multiple, math.ceil(max(fullest, 2) / multiple) * multiple)
    rows = [pack_rows(tokens, lengths, b, length, pad_id) for b in bins]
    return MicroBatchPlan(groups=[r.rows for r in rows], seq_length=length, packed=rows)


def padded_plan(batch_size: int, seq: int, micro: MicroBatching) -> MicroBatchPlan:
    """Consecutive padded micro-batches of `padded_group_size` sequences."""
    size = padded_group_size(batch_size, seq, micro)
    groups = [torch.arange(start, start + size) for start in range(0, batch_size, size)]
    return MicroBatchPlan(groups=groups, seq_length=seq)
