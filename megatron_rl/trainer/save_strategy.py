"""A synchronous `torch_dist` save strategy for Megatron's `dist_checkpointing` that writes in the calling process.

Megatron 0.16's default `TorchDistSaveShardedStrategy` is built for asynchronous saves during training: its writer
gets its results queue from a `multiprocessing` Manager started with the "spawn" method (a fresh interpreter that
re-imports the main module: seconds on a busy CPU host) and forks one writer process per file. Before planning it
also copies every tensor that is a view (the gate and up halves of each fused expert fc1, about two thirds of an
MoE checkpoint) into new memory all at once. A one-shot conversion needs none of that.

This strategy writes the same files (format, backend and version, one `__<rank>_0.distcp` per rank; Megatron's
own `dist_checkpointing.load` reads them unchanged) from the rank itself, copying views one at a time while it
writes, so the copies reuse freed memory instead of touching fresh pages (on the CPU VMs this runs on, first
touches of fresh memory cost several times the copy).
"""

from __future__ import annotations

import contextlib
import os
import queue
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.utils.serialization import config


@contextlib.contextmanager
def _no_zip_crc32() -> Iterator[None]:
    """`torch.save` without the zip CRC32 of every record, restored afterwards.

    Each tensor in a torch_dist file is a `torch.save` record; nothing reads the checksum back (`torch.load`,
    and with it `dist_checkpointing.load`, accepts a corrupted record either way; torch 2.13), and computing it
    costs about 40% of writing the bytes.
    """

    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = previous


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or a compact copy when it is a view: `torch.save` writes a tensor's whole storage."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def _write_file(transform_list: list, bucket: tuple) -> list:
    """Write one bucket's bytes and tensors to its file (fsync'd); return torch's write results."""
    path, storage_key, (bytes_data, tensor_data) = bucket
    with open(path, "wb") as stream, _no_zip_crc32():
        write = partial(
            _write_item,
            *transform_list,
            stream,
            storage_key=storage_key,
            serialization_format=SerializationFormat.TORCH_SAVE,
        )
        results = [write(data=data, write_item=item) for item, data in bytes_data]
        # Each copied view is dropped once written, so the next copy reuses its memory.
        results += [write(data=_own_storage(tensor), write_item=item) for item, tensor in tensor_data]
        stream.flush()
        os.fsync(stream.fileno())
    return results


def write_buckets_in_process(
    transform_list: list, use_msc: bool, rank: int, write_buckets: list, results_queue: queue.Queue
) -> None:
    """Write every bucket in this process; put {bucket index: write results}, or the error, on `results_queue`.

    The in-process counterpart of `FileSystemWriterAsync.write_preloaded_data_multiproc`, with the same result
    protocol: the writer's `retrieve_write_results` and Megatron's finalisation (which gathers every rank's
    results, so all ranks raise together on a failed write) work unchanged.
    """
    del use_msc, rank  # kept for the signature of the function it replaces; writes go to the local filesystem
    try:
        outcome: dict | Exception = {i: _write_file(transform_list, b) for i, b in enumerate(write_buckets)}
    except Exception as err:  # reported through the queue, as Megatron's writer processes do
        outcome = err
    results_queue.put(outcome)


class InProcessWriter(FileSystemWriterAsync):
    """Megatron's torch_dist file writer with one file per rank, written by the rank itself."""

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """One bucket holding every item of this rank's plan; views stay views until they are written."""
        items = [(item, planner.resolve_data(item)) for item in plan.items]
        self.write_buckets = []
        if items:
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            bytes_data = [(item, data) for item, data in items if item.type == WriteItemType.BYTE_IO]
            tensor_data = [(item, data) for item, data in items if item.type != WriteItemType.BYTE_IO]
            self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name, (bytes_data, tensor_data)))
        self.results_queue = queue.Queue() if self.write_buckets else None

    def get_save_function_and_args(self) -> tuple[Callable | None, Callable | None, list]:
        """Megatron's (write function, preload function, arguments), writing with `write_buckets_in_process`."""
        forking, preload, args = super().get_save_function_and_args()
        if forking is None:  # nothing to write on this rank
            return forking, preload, args
        return partial(write_buckets_in_process, *forking.args), preload, args


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """`torch_dist` saving with one file per rank, written synchronously by the rank (no helper processes)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=1)

    def async_save(self, sharded_state_dict: dict, checkpoint_dir: Path) -> AsyncRequest:
        """`TorchDistSaveShardedStrategy.async_save` with `InProcessWriter` and without the cached-plan reuse
        (which only pays off when the same model is saved again and again)."""
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        writer = InProcessWriter(checkpoint_dir, thread_count=1)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
        save_state_dict_ret, *_ = save_state_dict_async_plan(pyt_state_dict, writer, None, 0, planner=planner)
        return self._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
