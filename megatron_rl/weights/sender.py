"""Trainer side of a weight sync: build the plan once, then gather, pack (double-buffered) and broadcast.

Every trainer rank runs `send` (the TP/ETP all-gathers are collectives); only owner ranks pack and broadcast,
each on its own weight group.
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from megatron_rl.models import ModelArch, ModelFamily
from megatron_rl.models.naming import canonical_name
from megatron_rl.parallel.devices import compute_device
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.hf_weights import local_offsets, local_tensors, rule_for, tp_coords, uses_te_spec
from megatron_rl.weights import buckets as bucket_io
from megatron_rl.weights.gather import is_owner, iter_hf_tensors
from megatron_rl.weights.plan import BucketSpec, TensorSpec, plan_buckets
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
        for name, hf in zip(rule.hf, rule.to_hf(meta, arch)):
            dtype = str(hf.dtype).removeprefix("torch.")
            passes[rule.is_expert].append(TensorSpec(name, tuple(hf.shape), dtype, ctx.rank, rule.is_expert))
    return passes[False] + passes[True]


def build_plan(
    model,
    family: ModelFamily,
    arch: ModelArch,
    ctx: ParallelContext,
    bucket_bytes: int,
    unpacked_min_bytes: int | None = None,
    layouts: dict[str, str] | None = None,
    places: dict[str, tuple[str, int]] | None = None,
) -> list[BucketSpec]:
    """The same bucket plan on every trainer rank (specs all-gathered over the trainer's default group)."""
    mine = owned_tensor_specs(model, family, arch, ctx)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    specs = list(itertools.chain.from_iterable(everyone))
    return plan_buckets(specs, bucket_bytes, unpacked_min_bytes, layouts, places)


_SEND_BUFFERS: dict[tuple[int, str], bucket_io.DoubleBuffer] = {}
"""Send buffers by (bytes, device), kept from sync to sync: fresh memory costs a page fault per 4 KiB on first
touch, about as long as sending it on CPU."""


def send_buffers(nbytes: int, device: torch.device | str) -> bucket_io.DoubleBuffer:
    """This process's double buffer of at least `nbytes` on `device` (made once, then reused)."""
    key = (nbytes, str(device))
    if key not in _SEND_BUFFERS:
        _SEND_BUFFERS.clear()  # a new plan: drop the old buffers before making new ones
        _SEND_BUFFERS[key] = bucket_io.DoubleBuffer(nbytes, device)
    return _SEND_BUFFERS[key]


def send_update(
    model,
    family: ModelFamily,
    arch: ModelArch,
    ctx: ParallelContext,
    plan: list[BucketSpec],
    group: WeightGroup | None,
    version: int,
) -> dict:
    """Gather this rank's tensors and broadcast its buckets on `group` (None for ranks that own nothing)."""
    start = time.perf_counter()
    mine = [b for b in plan if b.owner == ctx.rank]
    device = compute_device()
    buffers = send_buffers(max((b.nbytes for b in mine), default=0), device) if mine else None
    try:
        with bucket_io.leave_a_core_to_transport(device):
            sent_bytes = _send_buckets(model, family, arch, ctx, mine, group, version, buffers)
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
) -> int:
    """Gather (every rank), pack and broadcast (owners) this rank's buckets in plan order; returns bytes sent."""
    queue = iter(mine)
    current = next(queue, None)
    pending: dict[str, torch.Tensor] = {}
    sent_bytes = 0
    tensors = itertools.chain(
        iter_hf_tensors(model, family, arch, ctx, experts=False),
        iter_hf_tensors(model, family, arch, ctx, experts=True),
    )
    for name, tensor in tensors:
        if current is None:
            raise RuntimeError(f"rank {ctx.rank}: tensor {name} is not in this rank's plan")
        pending[name] = tensor
        if len(pending) == len(current.slots):
            buffer = buffers.next_buffer(lambda work: wait(work, "broadcast", group))
            for source in bucket_io.broadcast_sources(buffer, current, pending, version):
                buffers.sent(group.broadcast(source, src=0), source)  # on the wire while the next is packed
            sent_bytes += current.nbytes
            pending = {}
            current = next(queue, None)
    if current is not None:
        raise RuntimeError(
            f"rank {ctx.rank}: bucket {current.index} was never filled (missing {len(current.slots) - len(pending)} tensors)"
        )
    if buffers is not None:
        buffers.wait(lambda work: wait(work, "broadcast", group))
    return sent_bytes
