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


def run_bench(spec: dict, _startup_s: float) -> None:
    """Timed syncs (gather + pack + send + load, engines acknowledged) against plain broadcasts of the same bytes:
    one broadcast of them all (the baseline), broadcasts of one bucket's size one after another, and such
    broadcasts with one under way per gloo stream (the transport's best, as the sync keeps several going)."""
    rank, _handles, sync, setup = connect(spec)
    chunk = max(b.nbytes for b in sync.plan)
    sync_s, raw_s, chunked_s, parallel_s, engine_side = [], [], [], [], []
    push_raw(sync, setup["bytes"])  # warm-up: first use of the sockets and of the baseline's buffers
    push_raw(sync, setup["bytes"], chunk, sync.streams)
    for version in range(1, spec["repeats"] + 1):
        perturb_weights(rank, seed=version, scale=spec["noise"])
        dist.barrier()
        pushed = sync.push(version)
        sync_s.append(pushed["seconds"])
        if rank.ctx.rank == 0:
            engine_side.append(
                [{**w, "engine_seconds": r["seconds"]} for r in pushed["engines"].values() for w in r["workers"]]
            )
        raw_s.append(push_raw(sync, setup["bytes"]))
        chunked_s.append(push_raw(sync, setup["bytes"], chunk))
        parallel_s.append(push_raw(sync, setup["bytes"], chunk, sync.streams))
    report = {"plan": setup, "sync_seconds": sync_s, "raw_seconds": raw_s, "chunked_seconds": chunked_s,
              "parallel_seconds": parallel_s, "chunk_bytes": chunk, "streams": sync.streams,
              "engine_side": engine_side}  # fmt: skip
    if rank.ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps(report))


if __name__ == "__main__":
    run_worker(run_bench)
