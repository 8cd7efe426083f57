"""How a batch's sequences are cut into micro-batches: by count, by tokens, or packed end to end without padding.

Pure logic (no process groups): the plan of which rows go together, and for packed micro-batches the packed row's
tokens, positions, labels, segment mask and the index that takes its outputs back to the batch's `[b, S]` layout.

Packing (`MicroBatching.pack`): whole sequences go back to back into rows as long as the batch's padded length
(first-fit decreasing, longest first), padded only at each row's tail; the rows are dealt out to the fewest
micro-batches that keep each within its token budget (`MicroBatching.budget`). Attention stays inside each
sequence (a block-diagonal causal mask, or Transformer Engine's `thd` format with cumulative sequence lengths). The rotary embedding turns a position
shift into a phase that cancels in every query-key product, so a sequence computes what it computes alone at
row start. Per-token results (logprobs, entropy) are computed on the packed rows and unpacked to `[b, S]`, so
everything per position (masks, old logprobs, routes) keeps the batch's layout.
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
    """Pack whole sequences end to end into rows of the padded length, no padding between them."""
    uniform: bool = False
    """Packed micro-batches hold as many rows on every data-parallel replica (the `allgather` MoE dispatcher
    gathers each micro-batch's tokens over the expert-parallel group, which takes one shape); otherwise each
    replica spreads its own rows over the agreed micro-batch count."""

    @classmethod
    def of(cls, trainer: TrainerConfig) -> MicroBatching:
        """The settings of the `trainer` config section."""
        return cls(
            size=trainer.micro_batch_size,
            tokens=trainer.micro_batch_tokens,
            pack=trainer.pack_sequences,
            uniform=trainer.moe_dispatcher == "allgather",
        )

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


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The indices of `lengths` in bins of `budget` tokens, longest first into the first that has room (one
    longer than the budget gets a bin of its own); each bin's indices ascending."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                free[b] -= n
                bins[b].append(i)
                break
        else:
            bins.append([i])
            free.append(max(0, budget - n))
    return [sorted(b) for b in bins]


@dataclasses.dataclass
class PackedRows:
    """One micro-batch's sequences packed end to end into `r` rows of `C` tokens, and the way back to `[b, S]`."""

    rows: Tensor
    """`[b]` int64 the batch rows it holds, in packing order."""
    tokens: Tensor
    """`[r, C]` int64 their tokens back to back, each row then padded."""
    positions: Tensor
    """`[r, C]` int64 each token's position within its own sequence (a row's padding counts on from 0)."""
    labels: Tensor
    """`[r, C]` int64 the next token of the same sequence (0 at each sequence's last token and in the padding)."""
    segments: Tensor
    """`[r, C]` int64 which of `rows` each token belongs to; row j's padding is segment b + j."""
    unpack: Tensor
    """`[b, S]` int64 the flat packed position (row * C + column) of each (row, t) of the batch layout (0 past a
    sequence's length)."""
    lengths: Tensor
    """`[b]` int64 the sequences' lengths."""

    @property
    def shape(self) -> tuple[int, int]:
        """(r, C): the packed rows and their length."""
        return tuple(self.tokens.shape)

    def padding(self) -> Tensor:
        """`[r, C]` bool, True at each row's tail padding (the MoE routers leave it out)."""
        return self.segments >= len(self.rows)

    def attention_mask(self) -> Tensor:
        """`[r, 1, C, C]` bool, True where a query may not attend: another segment, or a later position."""
        width = self.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same = self.segments[:, :, None] == self.segments[:, None, :]
        return ~(same & causal)[:, None]

    def cu_seqlens(self) -> Tensor:
        """Cumulative lengths of the segments of the rows laid end to end (each row's padding one of them), int32:
        Transformer Engine's `thd` format over the flattened `[1, r * C]` row."""
        flat = self.segments.reshape(-1)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), (flat[1:] != flat[:-1]).nonzero()[:, 0] + 1])
        return torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)

    def pack(self, per_position: Tensor, fill, local: bool = False) -> Tensor:
        """A batch-layout tensor `[B, S or S-1, ...]` (the whole batch's; with `local` this micro-batch's own `[b,
        ...]` in packing order) -> these rows' `[r, C, ...]`, `fill` in padding (and at each sequence's last
        token when it has S-1 columns)."""
        r, width = self.shape
        device = per_position.device
        source = per_position if local else per_position[self.rows.to(device)]
        columns = min(source.shape[1], self.unpack.shape[1])
        valid = (torch.arange(columns)[None, :] < self.lengths[:, None]).to(device)
        out = torch.full((r * width, *source.shape[2:]), fill, dtype=source.dtype, device=device)
        out[self.unpack[:, :columns].to(device)[valid]] = source[:, :columns][valid]
        return out.reshape(r, width, *source.shape[2:])

    def unpack_rows(self, packed: Tensor) -> Tensor:
        """These rows' outputs `[r, C, ...]` (or flattened `[1, r * C, ...]`) -> `[b, S, ...]` in the batch layout
        (with gradient); positions past a sequence's length hold the first output (every mask is 0 there)."""
        index = self.unpack.to(packed.device)
        flat = packed.reshape(-1, *packed.shape[2:]).index_select(0, index.reshape(-1))
        return flat.reshape(*index.shape, *packed.shape[2:])


def pack_rows(
    tokens: Tensor, lengths: Tensor, row_bins: Sequence[Sequence[int]], width: int, pad_id: int = 0
) -> PackedRows:
    """The batch rows of `row_bins` (one list per packed row) of `tokens` `[B, S]` (each `lengths[row]` real
    tokens) packed into rows of `width` tokens (ValueError when a row's do not fit)."""
    order = [row for rows in row_bins for row in rows]
    index = torch.as_tensor(order, dtype=torch.long)
    seq, r, b = tokens.shape[1], len(row_bins), len(order)
    packed = torch.full((r, width), pad_id, dtype=tokens.dtype)
    positions = torch.arange(width).repeat(r, 1)
    labels = torch.zeros(r, width, dtype=torch.long)
    segments = (b + torch.arange(r))[:, None].repeat(1, width)
    unpack = torch.zeros(b, seq, dtype=torch.long)
    i = 0
    for j, rows in enumerate(row_bins):
        start = 0
        for row in rows:
            n = int(lengths[row])
            if start + n > width:
                raise ValueError(f"packing: {sum(int(lengths[x]) for x in rows)} tokens do not fit a row of {width}")
            packed[j, start : start + n] = tokens[row, :n]
            positions[j, start : start + n] = torch.arange(n)
            labels[j, start : start + n - 1] = tokens[row, 1:n]
            segments[j, start : start + n] = i
            unpack[i, :n] = j * width + torch.arange(start, start + n)
            start, i = start + n, i + 1
        positions[j, start:] = torch.arange(width - start)
    return PackedRows(
        rows=index, tokens=packed, positions=positions, labels=labels, segments=segments, unpack=unpack,
        lengths=lengths[index].long() if b else torch.zeros(0, dtype=torch.long),
    )  # fmt: skip


@dataclasses.dataclass
class MicroBatchPlan:
    """Which batch rows each micro-batch holds (and, packed, how); every rank of a replica holds the same plan."""

    groups: list[Tensor]
    """Per micro-batch, `[b_i]` int64 batch rows (consecutive equal slices when padded)."""
    seq_length: int
    """The length every micro-batch's rows have: the batch's S, or the packed rows' common L."""
    packed: list[PackedRows] | None = None
    """Per micro-batch its packed rows; None: padded micro-batches (`tokens[group]`)."""
    rows: int = 0
    """Packed rows per micro-batch (0 when padded)."""

    @property
    def num_micro_batches(self) -> int:
        """How many micro-batches."""
        return len(self.groups)

    @property
    def rows_per_micro_batch(self) -> int:
        """The micro-batch size Megatron's schedule is told: packed rows, or sequences per padded micro-batch."""
        return self.rows if self.packed is not None else int(self.groups[0].numel())

    def token_fill(self, real_tokens: int) -> float:
        """`real_tokens` over the tokens the micro-batches run the model on (1: no padding)."""
        rows = self.rows * self.num_micro_batches if self.packed is not None else len(self.order())
        return real_tokens / max(1, rows * self.seq_length)

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
        """The batch's `[B, S, L, k]` routes and `[B, S]` free mask in micro-batch layout: every micro-batch's
        packed rows in turn `[n * r, C, ...]` (padding free), or the rows in `order()`."""
        if self.packed is None:
            order = self.order()
            return routes[order], free[order]
        packed = torch.cat([p.pack(routes, 0) for p in self.packed])
        return packed, torch.cat([p.pack(free, True) for p in self.packed])


def packed_rows_needed(lengths: Sequence[int], width: int) -> int:
    """Rows of `width` tokens first-fit decreasing packs sequences of `lengths` into."""
    return len(first_fit_decreasing(lengths, width))


def packed_plan(
    lengths: Tensor, tokens: Tensor, count: int, width: int, pad_id: int = 0, rows: int | None = None
) -> MicroBatchPlan:
    """The batch's sequences (`lengths` of `tokens` `[B, S]`) packed first-fit decreasing into rows of `width`
    tokens (at least the longest sequence; rows of the batch's own length keep the attention no larger than
    padded rows'), the rows dealt out in turn to `count` micro-batches of equal row counts (Megatron's schedule
    takes one micro-batch shape; the last ones may get empty rows): `rows` each when given (ValueError when they
    cannot hold them all), else as few as hold them."""
    sizes = lengths.tolist()
    if max(sizes, default=0) > width:
        raise ValueError(f"packing: a sequence of {max(sizes)} tokens does not fit a row of {width}")
    row_bins = first_fit_decreasing(sizes, width)
    per = max(1, math.ceil(len(row_bins) / count)) if rows is None else rows
    if per * count < len(row_bins):
        raise ValueError(f"packing: {len(row_bins)} rows do not fit {count} micro-batches of {per} rows")
    parts = [row_bins[i * per : (i + 1) * per] for i in range(count)]
    packed = [pack_rows(tokens, lengths, part + [[]] * (per - len(part)), width, pad_id) for part in parts]
    return MicroBatchPlan(groups=[p.rows for p in packed], seq_length=width, packed=packed, rows=per)


def padded_plan(batch_size: int, seq: int, micro: MicroBatching) -> MicroBatchPlan:
    """Consecutive padded micro-batches of `padded_group_size` sequences."""
    size = padded_group_size(batch_size, seq, micro)
    groups = [torch.arange(start, start + size) for start in range(0, batch_size, size)]
    return MicroBatchPlan(groups=groups, seq_length=seq)
