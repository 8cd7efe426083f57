"""Engine-worker side of a weight sync: join one weight group per trainer sender (publishing which experts this
worker hosts), receive every bucket of the plan that reaches it in order, and hand the tensors to an in-place
loader. Runs inside a vLLM worker process; imports no vLLM (the loader it is handed does).
"""

from __future__ import annotations

import collections
import json
import time
from typing import TYPE_CHECKING

import torch

from megatron_rl.parallel.devices import compute_device
from megatron_rl.weights import buckets as bucket_io
from megatron_rl.weights.owners import PLACEMENT_KEY, Placement, PlacementError
from megatron_rl.weights.plan import HEADER_BYTES, BucketSpec, Slot, plan_from_json
from megatron_rl.weights.transport import GroupSpec, TransportError, WeightGroup, wait

if TYPE_CHECKING:
    from megatron_rl.weights.engine.loader import InPlaceWeightLoader

RECEIVE_BUFFERS = 3
"""Buckets held at once by a receiving worker: one being loaded, two arriving (memory: 3 x the largest bucket)."""
MAX_BUCKETS_AHEAD = 8
"""Most buckets whose receives are posted at once (those received straight into the model take no buffer)."""


class WeightReceiver:
    """Holds this worker's weight groups between updates."""

    def __init__(self) -> None:
        self.groups: dict[int, WeightGroup] = {}
        self.member = 0
        """This worker's rank in every weight group (0 is the sender)."""
        self.placement: Placement = None
        """The expert placement this worker published when it joined (None: it hosts every expert)."""
        self._buffers: list[torch.Tensor] = []
        self._plan_json, self._plan = "", []

    def join(self, groups_json: str, member_rank: int, timeout_s: float, placement: Placement = None) -> dict:
        """Join every sender's group as `member_rank` (the same rank in each group), publishing `placement` (which
        experts this worker hosts) on each group's store first."""
        self.groups, self.member, self.placement = {}, member_rank, placement
        for data in json.loads(groups_json):
            spec = GroupSpec.from_dict(data)
            group = WeightGroup(spec, member_rank, timeout_s)
            group.publish(PLACEMENT_KEY, json.dumps(placement))
            self.groups[spec.sender] = group.connect()
        return {"groups": sorted(self.groups), "rank": member_rank, "placement": placement}

    def check_placement(self, now: Placement) -> None:
        """PlacementError unless the worker still hosts the experts it published when it joined: the trainer plans
        each expert's receivers from those (a placement that moved, by EPLB or elastic EP, is refused)."""
        if now != self.placement:
            raise PlacementError(
                f"weight-group rank {self.member}: the expert placement changed since this worker joined the weight "
                f"groups (published {_brief(self.placement)}, now {_brief(now)}); the sync plans from a fixed one"
            )

    def receive(self, version: int, plan_json: str, loader: InPlaceWeightLoader) -> dict:
        """Receive all buckets of update `version` in plan order; load them; finish the loader.

        Raises on a bucket that does not match the plan (BucketError) or a failed transfer (TransportError):
        the caller must then treat the engine's weights as inconsistent. The report splits the seconds into
        waiting for bytes, loading (the loader repacks every layer a bucket completes) and finishing.
        """
        if not self.groups:
            raise TransportError("receive before joining the weight groups")
        start = time.perf_counter()
        plan = [bucket for bucket in self._plan_of(plan_json) if bucket.reaches(self.member)]
        buffers = self._buffers_for(max((b.nbytes for b in plan), default=0))
        loader.begin_update()  # a fresh start also after an update that failed half-way
        with bucket_io.leave_a_core_to_transport(buffers[0].device if buffers else "cpu"):
            stats = self._receive_buckets(plan, buffers, version, loader)
        finish_start = time.perf_counter()
        loader.finish()
        end = time.perf_counter()
        return {"version": version, "member": self.member, **stats, "seconds": end - start,
                "finish_seconds": end - finish_start,
                "wire_layouts": loader.wire_layouts(), "wire_places": loader.wire_places(),
                **{f"loader_{k}": v for k, v in loader.timings.items()}}  # fmt: skip

    def _receive_buckets(
        self, plan: list[BucketSpec], buffers: list[torch.Tensor], version: int, loader: InPlaceWeightLoader
    ) -> dict:
        """Receive and load every bucket in order; returns bytes, tensors loaded (`in_place` of them received
        straight into the running model), seconds waiting for bytes, and per bucket the seconds waiting for it
        and loading it.

        Receives are posted ahead of the bucket being loaded, so the transfer goes on while a slow bucket (the
        first one: every dense layer, repacked as it completes) is loaded: as many buckets as there are free
        buffers, and any number (up to `MAX_BUCKETS_AHEAD`) of those that land wholly in the running model.
        """
        received = tensors = in_place = 0
        wait_s = 0.0
        per_bucket = []
        free = collections.deque(buffers)
        pending: collections.deque = collections.deque()
        posted = 0
        for bucket in plan:
            while posted < len(plan) and len(pending) < MAX_BUCKETS_AHEAD:
                entry = self._post(plan[posted], free, loader)
                if entry is None:  # it needs a buffer and every buffer is taken
                    break
                pending.append(entry)
                posted += 1
            view, works, group, placed, owned = pending.popleft()
            wait_start = time.perf_counter()
            for work in works:
                wait(work, f"bucket {bucket.index}", group)
            wait_s += time.perf_counter() - wait_start
            load_start = time.perf_counter()
            named = bucket_io.unpack(view, bucket, version, skip=placed)
            tensors += loader.load(named, placed=placed)
            if owned is not None:
                free.append(owned)  # the loader copied everything out of it
            in_place += len(placed)
            per_bucket.append((round(load_start - wait_start, 4), round(time.perf_counter() - load_start, 4)))
            received += bucket.nbytes
        return {"bytes": received, "tensors": tensors, "in_place": in_place, "wait_seconds": wait_s,
                "bucket_seconds": per_bucket}  # fmt: skip

    def _plan_of(self, plan_json: str) -> list[BucketSpec]:
        """The plan in `plan_json`, parsed once while the trainer keeps sending the same one."""
        if plan_json != self._plan_json:
            self._plan, self._plan_json = plan_from_json(plan_json), plan_json
        return self._plan

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

    def _post(self, bucket: BucketSpec, free: collections.deque, loader: InPlaceWeightLoader) -> tuple | None:
        """Start receiving one bucket (each of its broadcasts): (bucket view, works, group, names of the tensors
        received straight into the running model, the buffer it took from `free` or None); None when it needs a
        buffer and `free` is empty.

        A tensor that travels in a broadcast of its own goes straight to where the loader says it belongs
        (`direct_destination`: an expert tensor in a wire layout into the running model, a dense tensor into
        the staging parameter its layer is rebuilt from), which saves the loader a pass over its bytes;
        otherwise into a buffer, from which `unpack` puts it back into its own layout. A bucket whose every
        tensor goes straight needs only room for its header, which it gets on its own.
        """
        group = self.groups.get(bucket.owner)
        if group is None:
            raise TransportError(f"no weight group for sender {bucket.owner} (bucket {bucket.index})")
        targets: list[torch.Tensor | None] = [None] * len(bucket.broadcasts)
        placed = []
        for i, segment in enumerate(bucket.broadcasts):
            slots = [bucket.slots[k] for k in segment.slot_indices]
            destination = _direct_span(loader, slots)
            if destination is not None and destination.numel() == segment.nbytes:
                targets[i] = destination
                placed += [slot.name for slot in slots]
        needed = max((seg.end for seg, target in zip(bucket.broadcasts, targets) if target is None), default=0)
        owned = None
        if needed <= HEADER_BYTES:
            view = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=compute_device())
        elif not free:
            return None
        else:
            owned = free.popleft()
            view = owned[: bucket.nbytes]  # buffers are made to hold the plan's largest bucket
        for i, segment in enumerate(bucket.broadcasts):
            if targets[i] is None:
                targets[i] = view[segment.start : segment.end]
        if bucket.receivers:  # sent to this worker alone, point to point (it hosts the bucket's experts)
            works = [group.recv(target, 0, bucket.tag(i)) for i, target in enumerate(targets)]
        else:
            works = [group.broadcast(target, src=0) for target in targets]
        return view, works, group, placed, owned


def _brief(placement: Placement) -> str:
    """A placement in a few words, for errors."""
    if placement is None:
        return "every expert"
    layers = placement.get("layers", {})
    first = min(layers, key=int) if layers else None
    return f"experts {layers.get(first)} of layer {first} ({len(layers)} layers)" if first else "no layer"


def _direct_span(loader: InPlaceWeightLoader, slots: list[Slot]) -> torch.Tensor | None:
    """Where the loader takes these consecutive slots straight (`direct_destination`), as one flat uint8 span,
    when each lies right after the previous one in the same memory; else None (they come through a buffer, as
    a packed range, which has no slots, always does)."""
    first = None
    for slot in slots:
        destination = loader.direct_destination(slot.name, slot.layout, slot.shape, slot.dtype)
        if destination is None:
            return None
        if first is None:
            first, end = destination, destination.data_ptr() + destination.numel()
        elif (
            destination.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or destination.data_ptr() != end
        ):
            return None
        else:
            end += destination.numel()
    if first is None:
        return None
    return first.as_strided((end - first.data_ptr(),), (1,))
