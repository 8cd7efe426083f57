"""torchrun worker of the weight-sync benchmark (`weight_sync.py` runs it as `-m bench.weight_sync_trainer SPEC`):
the trainer at the spec's layout, timed syncs into the engines, and plain broadcasts of the same bytes over the
same weight group beside them (`weight_sync_baseline.py`). Rank 0 writes the report to the spec's `out`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from bench.weight_sync_baseline import RECEIVE_RAW, broadcast_chunks, chunks_buffer_bytes, kept_buffer
from megatron_rl.weights.sync import TrainerWeightSync, ray_get_named
from megatron_rl.workers import run_worker
from megatron_rl.workers.sync_check import connect, perturb_weights

_SEND_BUFFER: dict = {}
"""The baseline's send buffer, kept between its broadcasts (see `kept_buffer`)."""


def push_raw(sync: TrainerWeightSync, nbytes: int, chunk_bytes: int | None = None, in_flight: int = 1) -> float:
    """Broadcast `nbytes` from the first sender to every engine worker, loading nothing; wall seconds.

    One broadcast of all the bytes, or broadcasts of `chunk_bytes` with up to `in_flight` under way at once,
    between warm buffers kept for it at both ends; the sync's own buffers are left alone.
    """
    sender = min(b.owner for b in sync.plan)
    chunk_bytes = min(chunk_bytes or nbytes, nbytes)
    start = time.perf_counter()
    futures = {}
    if sync.is_coordinator:
        args = (sender, nbytes, chunk_bytes, in_flight)
        futures = {e.name: e.actor.collective_rpc.remote(RECEIVE_RAW, args, sync.timeout_s) for e in sync.engines}
    if sync.rank.ctx.rank == sender:
        buffer = kept_buffer(_SEND_BUFFER, chunks_buffer_bytes(nbytes, chunk_bytes, in_flight), fill=1)
        broadcast_chunks(sync.group, buffer, nbytes, chunk_bytes, in_flight)
    if sync.is_coordinator:
        ray_get_named(futures, sync.timeout_s, "raw broadcast")
    dist.barrier()
    return time.perf_counter() - start


def timed_push(rank, sync: TrainerWeightSync, version: int, noise: float) -> tuple[float, list[dict]]:
    """New weights pushed as `version`: wall seconds, and (rank 0) every engine worker's report."""
    perturb_weights(rank, seed=version, scale=noise)
    dist.barrier()
    pushed = sync.push(version)
    workers = []
    if rank.ctx.rank == 0:
        workers = [{**w, "engine_seconds": r["seconds"]} for r in pushed["engines"].values() for w in r["workers"]]
    return pushed["seconds"], workers


def compare_broadcast(rank, sync: TrainerWeightSync, repeats: int, noise: float) -> dict:
    """Owner-aware syncs (each expert only to the workers that host it) and syncs that broadcast every tensor to
    every worker, interleaved (which goes first alternates), after one warm-up sync of each: seconds and the
    bytes each engine worker received, per mode."""
    modes = {"owner_aware": True, "broadcast": False}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    received: dict[str, dict] = {}
    version = 0
    for round_ in range(repeats + 1):
        order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
        for mode in order:
            sync.set_owner_aware(modes[mode])
            version += 1
            took, workers = timed_push(rank, sync, version, noise)
            if round_ > 0:  # the first round learns the routes and layouts of both
                seconds[mode].append(took)
            received[mode] = {str(w.get("member")): w["bytes"] for w in workers}
    sync.set_owner_aware(True)
    return {"seconds": seconds, "received_bytes": received, "versions": version}


def run_bench(spec: dict, _startup_s: float) -> None:
    """Timed syncs (gather + pack + send + load, engines acknowledged) against plain broadcasts of the same bytes:
    one broadcast of them all (the baseline), broadcasts of one bucket's size one after another, and such
    broadcasts with one under way per gloo stream (the transport's best, as the sync keeps several going). With
    `compare_broadcast` (expert-parallel engines), owner-aware syncs interleaved with broadcast-everything ones
    first (`compare_broadcast`)."""
    rank, _handles, sync, setup = connect(spec)
    comparison = (
        compare_broadcast(rank, sync, spec["repeats"], spec["noise"]) if spec.get("compare_broadcast") else None
    )
    first_version = comparison["versions"] if comparison else 0
    chunk = max(b.nbytes for b in sync.plan)
    sync_s, raw_s, chunked_s, parallel_s, engine_side = [], [], [], [], []
    push_raw(sync, setup["bytes"])  # warm-up: first use of the sockets and of the baseline's buffers
    push_raw(sync, setup["bytes"], chunk, sync.streams)
    for version in range(first_version + 1, first_version + spec["repeats"] + 1):
        took, workers = timed_push(rank, sync, version, spec["noise"])
        sync_s.append(took)
        if rank.ctx.rank == 0:
            engine_side.append(workers)
        raw_s.append(push_raw(sync, setup["bytes"]))
        chunked_s.append(push_raw(sync, setup["bytes"], chunk))
        parallel_s.append(push_raw(sync, setup["bytes"], chunk, sync.streams))
    report = {"plan": setup, "sync_seconds": sync_s, "raw_seconds": raw_s, "chunked_seconds": chunked_s,
              "parallel_seconds": parallel_s, "chunk_bytes": chunk, "streams": sync.streams,
              "engine_side": engine_side, "comparison": comparison}  # fmt: skip
    if rank.ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps(report))


if __name__ == "__main__":
    run_worker(run_bench)
