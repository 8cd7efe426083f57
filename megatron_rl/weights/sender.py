"""Trainer side of a weight sync: the specs the plan is made from, then gather, pack (double-buffered) and send.

Every trainer rank runs `send_update` (the TP/ETP all-gathers are collectives); only owner ranks pack and send,
each on its own weight group: a broadcast to every engine worker, or for the expert tensors of expert-parallel
engines point-to-point sends to the workers that host them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_rl.models import ModelArch, ModelFamily
from megatron_rl.models.naming import canonical_name
from megatron_rl.parallel.devices import compute_device
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.hf_weights import local_offsets, local_tensors, rule_for, tp_coords, uses_te_spec
from megatron_rl.weights import buckets as bucket_io
from megatron_rl.weights.gather import is_owner, iter_hf_tensors
from megatron_rl.weights.plan import BucketSpec, TensorSpec
from megatron_rl.weights.transport import WeightGroup, wait


def owned_tensor_specs(model, family: ModelFamily, arch: ModelArch, ctx: ParallelContext) -> list[TensorSpec]:
    """The HF tensors this rank will yield, in yield order (non-expert pass, then expert pass), from shapes only.

    Full shapes come from the local shard shapes; the HF shapes from running the rule's transform on meta
    tensors, so nothing is gathered.
    """
    table = family.rule_table(arch, te_spec=uses_te_spec(model))
    layer_offset, expert_offset = local_offsets(model, ctx, arch)
    passes: dict[bool, list[TensorSpec]] = {False: [], True: []}
    for local, tensor in local_tensors(model).items():
        canonical = canonical_name(local, layer_offset, expert_offset)
        if canonical == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        rule = rule_for(table, canonical, arch)
        if not is_owner(rule, ctx):
            continue
        shape = list(tensor.shape)
        size, _ = tp_coords(rule, ctx)
        if rule.tp_dim is not None:
            shape[rule.tp_dim] *= size
        meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
        where = (rule.layer, rule.expert) if rule.is_expert else (None, None)
        for name, hf in zip(rule.hf, rule.to_hf(meta, arch)):
            dtype = str(hf.dtype).removeprefix("torch.")
            passes[rule.is_expert].append(TensorSpec(name, tuple(hf.shape), dtype, ctx.rank, rule.is_expert, *where))
    return passes[False] + passes[True]


def gather_specs(model, family: ModelFamily, arch: ModelArch, ctx: ParallelContext) -> list[TensorSpec]:
    """Every rank's `owned_tensor_specs`, in rank order, on every rank (a collective over the default group)."""
    mine = owned_tensor_specs(model, family, arch, ctx)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return list(itertools.chain.from_iterable(everyone))


_SEND_BUFFERS: dict[tuple[int, str], bucket_io.DoubleBuffer] = {}
"""Send buffers by (bytes, device), kept from sync to sync: fresh memory costs a page fault per 4 KiB on first
touch, about as long as sending it on CPU."""


def send_buffers(nbytes: int, device: torch.device | str) -> bucket_io.DoubleBuffer:
    """This process's double buffer of at least `nbytes` on `device` (made once, then reused while large enough:
    plans that alternate, as in the benchmark, keep warm memory)."""
    for (size, where), buffers in _SEND_BUFFERS.items():
        if where == str(device) and size >= nbytes:
            return buffers
    _SEND_BUFFERS.clear()  # a larger plan: drop the old buffers before making new ones
    _SEND_BUFFERS[(nbytes, str(device))] = bucket_io.DoubleBuffer(nbytes, device)
    return _SEND_BUFFERS[(nbytes, str(device))]


def send_update(
    model,
    family: ModelFamily,
    arch: ModelArch,
    ctx: ParallelContext,
    plan: list[BucketSpec],
    group: WeightGroup | None,
    version: int,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> dict:
    """Gather this rank's tensors and broadcast its buckets on `group` (None for ranks that own nothing).

    `tensors`: what to send instead of the full weights, as (HF name, full tensor) in the plan's names (the LoRA
    adapters of an adapter-only sync); every rank must pass its own (their gathers are collectives)."""
    start = time.perf_counter()
    mine = [b for b in plan if b.owner == ctx.rank]
    device = compute_device()
    buffers = send_buffers(max((b.nbytes for b in mine), default=0), device) if mine else None
    try:
        with bucket_io.leave_a_core_to_transport(device):
            sent_bytes = _send_buckets(model, family, arch, ctx, mine, group, version, buffers, tensors)
    except BaseException:
        _SEND_BUFFERS.clear()  # a failed send may leave work in flight on them: the next sync starts afresh
        raise
    return {"rank": ctx.rank, "buckets": len(mine), "bytes": sent_bytes, "seconds": time.perf_counter() - start}


def _send_buckets(
    model,
    family: ModelFamily,
    arch: ModelArch,
    ctx: ParallelContext,
    mine: list[BucketSpec],
    group: WeightGroup | None,
    version: int,
    buffers: bucket_io.DoubleBuffer | None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> int:
    """Gather (every rank), pack and send (owners) this rank's buckets in plan order; returns bytes sent."""
    filler = BucketFiller(mine, ctx.rank)
    sent_bytes = 0
    if tensors is None:
        tensors = itertools.chain(
            iter_hf_tensors(model, family, arch, ctx, experts=False),
            iter_hf_tensors(model, family, arch, ctx, experts=True),
        )
    for name, tensor in tensors:
        for bucket, filled in filler.add(name, tensor):
            sent_bytes += _send_bucket(bucket, filled, group, version, buffers)
    filler.check_complete()
    if buffers is not None:
        buffers.wait(lambda work: wait(work, "transfer", group))
    return sent_bytes


class BucketFiller:
    """Puts one rank's tensors into its buckets as the gather yields them, and hands the buckets out in plan
    order, each as soon as it and every bucket before it are full.

    A tensor may come before its bucket's turn (the point-to-point buckets of several receiver sets fill side by
    side, see `plan_buckets`): it waits in its bucket, so at most one open bucket per receiver set is held."""

    def __init__(self, mine: list[BucketSpec], rank: int):
        self.mine, self.rank = mine, rank
        self.bucket_of = {slot.name: i for i, bucket in enumerate(mine) for slot in bucket.slots}
        self.pending: list[dict[str, torch.Tensor]] = [{} for _ in mine]
        self.following = 0
        """Index (in `mine`) of the next bucket to hand out."""

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[BucketSpec, dict[str, torch.Tensor]]]:
        """Take one tensor; return the buckets (with their tensors) that are now ready to send, in order."""
        index = self.bucket_of.get(name)
        if index is None or index < self.following or name in self.pending[index]:
            raise RuntimeError(f"rank {self.rank}: tensor {name} is not in this rank's plan (or came twice)")
        self.pending[index][name] = tensor
        ready = []
        while self.following < len(self.mine) and len(self.pending[self.following]) == len(
            self.mine[self.following].slots
        ):
            ready.append((self.mine[self.following], self.pending[self.following]))
            self.pending[self.following] = {}
            self.following += 1
        return ready

    def held(self) -> int:
        """Tensors taken but not handed out yet."""
        return sum(len(p) for p in self.pending)

    def check_complete(self) -> None:
        """RuntimeError naming the first bucket that never filled."""
        if self.following < len(self.mine):
            bucket = self.mine[self.following]
            missing = len(bucket.slots) - len(self.pending[self.following])
            raise RuntimeError(f"rank {self.rank}: bucket {bucket.index} was never filled (missing {missing} tensors)")


def _send_bucket(
    bucket: BucketSpec, tensors: dict[str, torch.Tensor], group: WeightGroup, version: int, buffers
) -> int:
    """Pack one bucket into the next send buffer and start its transfers (each on the wire while the next is
    packed); returns its bytes."""
    buffer = buffers.next_buffer(lambda work: wait(work, "transfer", group))
    for index, source in enumerate(bucket_io.broadcast_sources(buffer, bucket, tensors, version)):
        for work in transmit(group, bucket, index, source):
            buffers.sent(work, source)
    return bucket.nbytes


def transmit(group: WeightGroup, bucket: BucketSpec, index: int, source: torch.Tensor) -> list:
    """Start the bucket's `index`-th transfer of `source`: one broadcast to every member, or a point-to-point send
    to each of the bucket's receivers (the workers that host its experts)."""
    if not bucket.receivers:
        return [group.broadcast(source, src=0)]
    return [group.send(source, dst, bucket.tag(index)) for dst in bucket.receivers]
