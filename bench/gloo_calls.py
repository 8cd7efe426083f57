"""Benchmark: the CPU each small gloo collective costs, two ranks on loopback (what a step's collectives cost on CPU).

    .venv/bin/python bench/gloo_calls.py [--calls 400]

Two processes join a gloo process group on 127.0.0.1 and time each call `--calls` times after 30 warm-up calls:
the CPU seconds of every thread of the process (the caller's and gloo's own) and the wall time, per call.
Printed (one JSON object): per call, rank 0's `cpu_ms` and `wall_ms`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _calls() -> dict:
    """The calls timed, by name (tensors made once, as in a training step)."""
    a2a_in, a2a_out = torch.randn(65536), torch.empty(65536)  # 256 KB: a quickstart layer's dispatch
    tiny_in, tiny_out = torch.randn(4), torch.empty(4)
    one, two, eight = torch.zeros(1), torch.zeros(2, dtype=torch.float64), torch.zeros(8)
    gathered = torch.empty(8)
    return {
        "all_to_all_single_256KB": lambda: dist.all_to_all_single(a2a_out, a2a_in),
        "all_to_all_single_16B": lambda: dist.all_to_all_single(tiny_out, tiny_in),
        "all_reduce_1": lambda: dist.all_reduce(one),
        "all_reduce_2_float64": lambda: dist.all_reduce(two),
        "all_reduce_8": lambda: dist.all_reduce(eight),
        "broadcast_16B": lambda: dist.broadcast(tiny_in, src=0),
        "all_gather_into_tensor_16B": lambda: dist.all_gather_into_tensor(gathered, tiny_in),
        "barrier": lambda: dist.barrier(),
        "all_gather_object": lambda: dist.all_gather_object([None, None], {"step": 1}),
    }


def _rank(rank: int, port: int, calls: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    report = {}
    for name, call in _calls().items():
        for _ in range(30):
            call()
        dist.barrier()
        cpu, wall = _cpu_s(), time.perf_counter()
        for _ in range(calls):
            call()
        wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
        report[name] = {"cpu_ms": round(1000 * cpu / calls, 3), "wall_ms": round(1000 * wall / calls, 3)}
    if rank == 0:
        out.update(report)
    dist.destroy_process_group()


def main() -> None:
    """Time the calls on two ranks and print rank 0's figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, args.calls, out), nprocs=2, join=True)
        print(json.dumps({"ranks": 2, "calls": args.calls} | dict(out)), flush=True)


if __name__ == "__main__":
    main()
