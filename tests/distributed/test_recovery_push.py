"""`RecoveringSync.push` on two real gloo ranks: a push that fails on one rank is retried on every rank, with that
rank's message; a clean push costs one small all-reduce and returns the inner report; an engine restart that takes
longer than a collective may wait is still waited for (rank 0 keeps the other ranks posted), and none coming in
time fails every rank with rank 0's message, not a collective timeout. The engines' side is not here (the inner
sync and the roster are stand-ins; `tests/e2e/test_faults.py` kills real engines)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time

import pytest
import torch.distributed as dist

from megatron_rl.weights import recovery
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


COLLECTIVE_TIMEOUT_S = 3
"""The ranks' gloo timeout: shorter than the restarts the slow cases wait for."""


class _Recovering(RecoveringSync):
    """The roster (rank 0's only) shows the restarted engine `restart_after_s` after the first look; never: inf."""

    def __init__(self, inner, restart_after_s: float, timeout_s: float):
        self.phases: list[str] = []
        super().__init__(inner, control=None, timeout_s=timeout_s, poll_s=0.0, on_phase=self.phases.append)
        self.restart_after_s, self.first_look = restart_after_s, None

    def roster_changed(self) -> dict | None:
        self.first_look = self.first_look or time.monotonic()
        if time.monotonic() - self.first_look >= self.restart_after_s:
            return {"epoch": 1, "engines": ["e1-restarted"], "down": []}
        return None

    def resync(self, roster: dict, version: int) -> dict:
        self.epoch = roster["epoch"]
        return self.sync.push(version) | {"roster": roster["engines"]}


def _rank(rank: int, port: int, queue, restart_after_s: float, timeout_s: float) -> None:
    try:
        recovery.RESTART_NEWS_S = 0.5
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )  # fmt: skip
        inner = _InnerSync(rank)
        recovering = _Recovering(inner, restart_after_s, timeout_s)
        reports = [recovering.push(7), recovering.push(8)]
        queue.put((rank, reports, inner.pushes, recovering.phases))
    except BaseException as err:  # the parent reports it
        queue.put((rank, repr(err), None, None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(restart_after_s: float = 0.0, timeout_s: float = 5.0) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue, restart_after_s, timeout_s)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, reports, pushes, phases = queue.get(timeout=60)
        out[rank] = (reports, pushes, phases)
    for p in procs:
        p.join(timeout=30)
    return out


@pytest.mark.parametrize(
    "restart_after_s", [0.0, 2 * COLLECTIVE_TIMEOUT_S], ids=["at-once", "slower-than-a-collective"]
)
def test_a_push_that_fails_on_one_rank_is_retried_on_every_rank_and_a_clean_one_is_not(restart_after_s):
    out = _run(restart_after_s, timeout_s=4 * COLLECTIVE_TIMEOUT_S)
    for rank in (0, 1):
        reports, pushes, phases = out[rank]
        assert pushes == [7, 8, 8], f"rank {rank}: only the failed push goes again: {out}"
        assert phases == ["waiting for an engine's restart (engine e1 died under rank 1)"]  # the heartbeat's
        assert reports[0] == {"version": 7, "rank": rank}
        assert reports[1]["recovered_from"] == "engine e1 died under rank 1"
        assert reports[1]["roster"] == ["e1-restarted"] and reports[1]["version"] == 8


def test_no_restart_in_time_fails_every_rank_with_rank0s_message():
    out = _run(restart_after_s=float("inf"), timeout_s=2 * COLLECTIVE_TIMEOUT_S)
    for rank in (0, 1):
        error, pushes, _ = out[rank]
        assert pushes is None and error.startswith("SyncError("), f"rank {rank}: {out}"
        assert "no engine restart came within 6 s: engine e1 died under rank 1" in error, f"rank {rank}: {error}"
