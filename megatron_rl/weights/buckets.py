"""Packing full tensors into flat byte buckets (per the plan) and reading them back, without copies on receive.

A bucket is one uint8 buffer: a 64-byte int64 header (magic, version, index, size) then each tensor's bytes at
its planned, 64-byte-aligned offset. Mixed dtypes share a bucket; the receiver views each slot as its dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from megatron_rl.weights.plan import HEADER_BYTES, BucketSpec

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
    if buffer.dtype != torch.uint8 or buffer.numel() < bucket.nbytes:
        raise ValueError(
            f"buffer of {buffer.numel()} {buffer.dtype} cannot hold bucket {bucket.index} ({bucket.nbytes} bytes)"
        )
    view = buffer[: bucket.nbytes]
    write_header(view, bucket, version)
    for slot in bucket.slots:
        tensor = tensors[slot.name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != _dtype(slot.dtype):
            raise ValueError(
                f"{slot.name}: got {tuple(tensor.shape)} {tensor.dtype}, the plan says {slot.shape} {slot.dtype}"
            )
        view[slot.offset : slot.offset + slot.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return view


def unpack(buffer: torch.Tensor, bucket: BucketSpec, version: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket, after checking its header."""
    check_header(buffer, bucket, version)
    for slot in bucket.slots:
        raw = buffer[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(_dtype(slot.dtype)).reshape(slot.shape)


class DoubleBuffer:
    """Two send buffers used alternately, so packing bucket k+1 overlaps sending bucket k."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu"):
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.pending: list = [None, None]
        self.turn = 0

    def next_buffer(self, wait_fn=None) -> torch.Tensor:
        """The buffer to fill next; waits (through `wait_fn(work)` if given) for its previous send first."""
        self.turn ^= 1
        work, self.pending[self.turn] = self.pending[self.turn], None
        if work is not None:
            (wait_fn or (lambda w: w.wait()))(work)
        return self.buffers[self.turn]

    def sent(self, work) -> None:
        """Record the in-flight send of the buffer returned by the last `next()`."""
        self.pending[self.turn] = work

    def wait(self) -> None:
        """Wait for every in-flight send (raises what a failed send raised)."""
        for i, work in enumerate(self.pending):
            self.pending[i] = None
            if work is not None:
                work.wait()


@contextlib.contextmanager
def leave_a_core_to_transport(device: torch.device | str) -> Iterator[None]:
    """On CPU, run torch ops with one intra-op thread fewer while buckets are in flight (at least one).

    The transfer itself runs on the process group's own thread. A multi-threaded copy waits at its end for its
    slowest thread; when that thread shares a core with the transfer (2 cores here) a 64 MiB copy measured
    5 ms single-threaded and 15-230 ms on two threads. GPU work is unaffected.
    """
    if torch.device(device).type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
