"""The weight-sync benchmark's baseline: plain broadcasts of the sync's bytes over the same weight group, loading
nothing, run alike by the sender (`weight_sync_trainer.py`) and every engine worker (`BaselineWeightExtension`,
which `weight_sync.py` names in the engine's `EngineSpec.worker_extension`).

Imported as `bench.weight_sync_baseline` (the repository root on PYTHONPATH, which `weight_sync.py` sets for
Ray's and torchrun's processes); it imports no vLLM and no Megatron.
"""

from __future__ import annotations

import collections
import time

import torch

from megatron_rl.parallel.devices import compute_device
from megatron_rl.weights.engine.worker import WeightUpdateExtension
from megatron_rl.weights.transport import WeightGroup, wait


def chunks_buffer_bytes(nbytes: int, chunk_bytes: int, in_flight: int) -> int:
    """The buffer `broadcast_chunks` needs: room for `in_flight` chunks, or for all of `nbytes` if less."""
    return min(nbytes, chunk_bytes * in_flight)


def broadcast_chunks(group: WeightGroup, buffer: torch.Tensor, nbytes: int, chunk_bytes: int, in_flight: int) -> None:
    """`nbytes` in broadcasts of `chunk_bytes` from (into) `buffer` (at least `chunks_buffer_bytes`), with up to
    `in_flight` of them under way at once, each in its own part of `buffer`."""
    parts = max(1, min(in_flight, -(-nbytes // chunk_bytes)))
    works: collections.deque = collections.deque()
    for index, offset in enumerate(range(0, nbytes, chunk_bytes)):
        if len(works) == parts:
            wait(works.popleft(), "baseline broadcast", group)
        place = (index % parts) * chunk_bytes
        works.append(group.broadcast(buffer[place : place + min(chunk_bytes, nbytes - offset)], src=0))
    for work in works:
        wait(work, "baseline broadcast", group)


def kept_buffer(holder: dict, nbytes: int, fill: int | None = None) -> torch.Tensor:
    """A buffer of at least `nbytes` kept in `holder` between calls (warm memory, as the sync's buffers are:
    fresh memory costs a page fault per 4 KiB); filled with `fill` when made (a send buffer's pages exist)."""
    buffer = holder.get("buffer")
    if buffer is None or buffer.numel() < nbytes:
        holder.pop("buffer", None)  # free the old one first
        buffer = holder["buffer"] = torch.empty(nbytes, dtype=torch.uint8, device=compute_device())
        if fill is not None:
            buffer.fill_(fill)
    return buffer


class BaselineWeightExtension(WeightUpdateExtension):
    """The production worker extension plus the baseline's receiving end."""

    def mrl_receive_raw(self, sender: int, nbytes: int, chunk_bytes: int, in_flight: int = 1) -> dict:
        """Receive `nbytes` from `sender`'s weight group in broadcasts of `chunk_bytes` (`broadcast_chunks`),
        into a buffer of the baseline's own, not the update's."""
        group = self.mrl_weight_receiver().groups[sender]
        holder = self.__dict__.setdefault("_mrl_raw_buffer", {})
        buffer = kept_buffer(holder, chunks_buffer_bytes(nbytes, chunk_bytes, in_flight))
        start = time.perf_counter()
        broadcast_chunks(group, buffer, nbytes, chunk_bytes, in_flight)
        return {"bytes": nbytes, "seconds": time.perf_counter() - start}


RECEIVE_RAW = BaselineWeightExtension.mrl_receive_raw.__name__
"""RPC: the baseline's receiving end (args: sender, bytes, chunk bytes, broadcasts in flight)."""
