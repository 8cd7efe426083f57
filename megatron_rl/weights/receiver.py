"""Engine-worker side of a weight sync: join one weight group per trainer sender, receive every bucket of the
plan in order, and hand the tensors to an in-place loader. Runs inside a vLLM worker process.
"""

from __future__ import annotations

import json
import time

import torch

from megatron_rl.parallel.groups import compute_device
from megatron_rl.weights import buckets as bucket_io
from megatron_rl.weights.plan import plan_from_json
from megatron_rl.weights.transport import GroupSpec, TransportError, WeightGroup, wait


class WeightReceiver:
    """Holds this worker's weight groups between updates."""

    def __init__(self) -> None:
        self.groups: dict[int, WeightGroup] = {}

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
        the caller must then treat the engine's weights as inconsistent.
        """
        if not self.groups:
            raise TransportError("receive before joining the weight groups")
        start = time.perf_counter()
        device = compute_device()
        plan = plan_from_json(plan_json)
        received = 0
        tensors = 0
        pending = self._post(plan[0], device) if plan else None
        for i, bucket in enumerate(plan):
            buffer, work, group = pending
            wait(work, f"bucket {bucket.index}", group)
            # Post the next receive before loading this bucket, so the transfer overlaps the load.
            pending = self._post(plan[i + 1], device) if i + 1 < len(plan) else None
            tensors += loader.load(bucket_io.unpack(buffer, bucket, version))
            received += bucket.nbytes
        finish_start = time.perf_counter()
        loader.finish()
        end = time.perf_counter()
        return {"version": version, "bytes": received, "tensors": tensors, "seconds": end - start,
                "finish_seconds": end - finish_start}  # fmt: skip

    def _post(self, bucket, device) -> tuple:
        """Start receiving one bucket: (buffer, work, group)."""
        group = self.groups.get(bucket.owner)
        if group is None:
            raise TransportError(f"no weight group for sender {bucket.owner} (bucket {bucket.index})")
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        return buffer, group.broadcast(buffer, src=0), group

    def receive_raw(self, sender: int, nbytes: int, chunk_bytes: int) -> dict:
        """Baseline for benchmarks: receive `nbytes` from `sender` in chunks, loading nothing."""
        group = self.groups[sender]
        start = time.perf_counter()
        buffer = torch.empty(chunk_bytes, dtype=torch.uint8)
        for offset in range(0, nbytes, chunk_bytes):
            wait(group.broadcast(buffer[: min(chunk_bytes, nbytes - offset)], src=0), "raw chunk", group)
        return {"bytes": nbytes, "seconds": time.perf_counter() - start}
