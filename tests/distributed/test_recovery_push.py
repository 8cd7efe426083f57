"""`RecoveringSync.push` on two real gloo ranks: a push that fails on one rank is retried on every rank, with that
rank's message; a clean push costs one small all-reduce and returns the inner report. The engines' side is not
here (the inner sync and the roster are stand-ins; `tests/e2e/test_faults.py` kills real engines)."""

from __future__ import annotations

import datetime
import multiprocessing as mp

import torch.distributed as dist

from megatron_rl.weights.recovery import RecoveringSync
from megatron_rl.weights.sync import SyncError
from megatron_rl.weights.transport import free_port


class _InnerSync:
    """Pushes succeed, except the second on rank 1."""

    def __init__(self, rank: int):
        self.rank, self.pushes = rank, []
        self.is_coordinator = rank == 0

    def push(self, version: int) -> dict:
        self.pushes.append(version)
        if self.rank == 1 and len(self.pushes) == 2:
            raise SyncError(f"engine e1 died under rank {self.rank}")
        return {"version": version, "rank": self.rank}


class _Recovering(RecoveringSync):
    def _await_restart(self, reason: str) -> dict:
        return {"epoch": 1, "engines": ["e1-restarted"], "down": [], "reason": reason}

    def resync(self, roster: dict, version: int) -> dict:
        self.epoch = roster["epoch"]
        return self.sync.push(version) | {"roster": roster["engines"]}


def _rank(rank: int, port: int, queue) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=30),
        )  # fmt: skip
        inner = _InnerSync(rank)
        recovering = _Recovering(inner, control=None, timeout_s=5)
        reports = [recovering.push(7), recovering.push(8)]
        queue.put((rank, reports, inner.pushes))
    except BaseException as err:  # the parent reports it
        queue.put((rank, repr(err), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run() -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, reports, pushes = queue.get(timeout=60)
        out[rank] = (reports, pushes)
    for p in procs:
        p.join(timeout=30)
    return out


def test_a_push_that_fails_on_one_rank_is_retried_on_every_rank_and_a_clean_one_is_not():
    out = _run()
    for rank in (0, 1):
        reports, pushes = out[rank]
        assert pushes == [7, 8, 8], f"rank {rank}: only the failed push goes again: {out}"
        assert reports[0] == {"version": 7, "rank": rank}
        assert reports[1]["recovered_from"] == "engine e1 died under rank 1"
        assert reports[1]["roster"] == ["e1-restarted"] and reports[1]["version"] == 8
