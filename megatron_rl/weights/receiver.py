"""Engine-worker side of a weight sync: join one weight group per trainer sender, receive every bucket of the
plan in order, and hand the tensors to an in-place loader. Runs inside a vLLM worker process.
"""

from __future__ import annotations

import collections
import json
import time

import torch

from megatron_rl.parallel.groups import compute_device
from megatron_rl.weights import buckets as bucket_io
from megatron_rl.weights.plan import BucketSpec, plan_from_json
from megatron_rl.weights.transport import GroupSpec, TransportError, WeightGroup, wait

RECEIVE_BUFFERS = 3
"""Buckets held at once by a receiving worker: one being loaded, two arriving (memory: 3 x the largest bucket)."""


class WeightReceiver:
    """Holds this worker's weight groups between updates."""

    def __init__(self) -> None:
        self.groups: dict[int, WeightGroup] = {}
        self._buffers: list[torch.Tensor] = []

    def join(self, groups_json: str, member_rank: int, timeout_s: float) -> dict:
        """Join every sender's group as `member_rank` (the same rank in each group)."""
        self.groups = {}
        for data in json.loads(groups_json):
            spec = GroupSpec.from_dict(data)
            self.groups[spec.sender] = WeightGroup(spec, member_rank, timeout_s).connect()
        return {"groups": sorted(self.groups), "rank": member_rank}

    def receive(self, version: int, plan_json: str, loader) -> dict:
        """Receive all buckets of update `version` in plan order; load them; finish the loader.

        Raises on a bucket that does not match the plan (BucketError) or a failed transfer (TransportError):
        the caller must then treat the engine's weights as inconsistent. The report splits the seconds into
        waiting for bytes, loading (the loader repacks every layer a bucket completes) and finishing.
        """
        if not self.groups:
            raise TransportError("receive before joining the weight groups")
        start = time.perf_counter()
        plan = plan_from_json(plan_json)
        buffers = self._buffers_for(max((b.nbytes for b in plan), default=0))
        loader.begin_update()  # a fresh start also after an update that failed half-way
        with bucket_io.leave_a_core_to_transport(buffers[0].device if buffers else "cpu"):
            received, tensors, wait_s = self._receive_buckets(plan, buffers, version, loader)
        finish_start = time.perf_counter()
        loader.finish()
        end = time.perf_counter()
        phases = getattr(loader, "timings", {})
        return {"version": version, "bytes": received, "tensors": tensors, "seconds": end - start,
                "wait_seconds": wait_s, "finish_seconds": end - finish_start,
                **{f"loader_{k}": v for k, v in phases.items()}}  # fmt: skip

    def _receive_buckets(
        self, plan: list[BucketSpec], buffers: list[torch.Tensor], version: int, loader
    ) -> tuple[int, int, float]:
        """Receive and load every bucket in order: (bytes, tensors loaded, seconds spent waiting for bytes).

        Receives are posted `len(buffers) - 1` buckets ahead of the one being loaded, so the transfer goes on
        while a slow bucket (the first one: every dense layer, repacked as it completes) is loaded.
        """
        received = tensors = 0
        wait_s = 0.0
        pending = collections.deque(
            self._post(bucket, buffers[i % len(buffers)]) for i, bucket in enumerate(plan[: len(buffers) - 1])
        )
        for i, bucket in enumerate(plan):
            buffer, work, group = pending.popleft()
            wait_start = time.perf_counter()
            wait(work, f"bucket {bucket.index}", group)
            wait_s += time.perf_counter() - wait_start
            ahead = i + len(buffers) - 1
            if ahead < len(plan):
                pending.append(self._post(plan[ahead], buffers[ahead % len(buffers)]))
            tensors += loader.load(bucket_io.unpack(buffer, bucket, version))
            received += bucket.nbytes
        return received, tensors, wait_s

    def _buffers_for(self, nbytes: int) -> list[torch.Tensor]:
        """`RECEIVE_BUFFERS` receive buffers of at least `nbytes`, kept between updates.

        Fresh memory costs a page fault per 4 KiB on first touch (about as long as receiving it here), and
        the loader copies (or prepacks) every tensor out of a bucket before its buffer is posted again.
        """
        if len(self._buffers) != RECEIVE_BUFFERS or self._buffers[0].numel() < nbytes:
            device = compute_device()
            self._buffers = []  # free the old ones first
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(RECEIVE_BUFFERS)]
        return self._buffers

    def _post(self, bucket: BucketSpec, buffer: torch.Tensor) -> tuple:
        """Start receiving one bucket into the front of `buffer`: (bucket view, work, group)."""
        group = self.groups.get(bucket.owner)
        if group is None:
            raise TransportError(f"no weight group for sender {bucket.owner} (bucket {bucket.index})")
        view = buffer[: bucket.nbytes]
        return view, group.broadcast(view, src=0), group

    def receive_raw(self, sender: int, nbytes: int, chunk_bytes: int) -> dict:
        """Baseline for benchmarks: receive `nbytes` from `sender` in chunks, loading nothing."""
        group = self.groups[sender]
        start = time.perf_counter()
        buffer = self._buffers_for(chunk_bytes)[0]  # the update's own (warm) receive buffer
        for offset in range(0, nbytes, chunk_bytes):
            wait(group.broadcast(buffer[: min(chunk_bytes, nbytes - offset)], src=0), "raw chunk", group)
        return {"bytes": nbytes, "seconds": time.perf_counter() - start}
