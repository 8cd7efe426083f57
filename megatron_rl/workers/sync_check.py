"""torchrun worker of `verify sync`: load the trainer, change its weights, sync them to the engines, and compare
the engines' logprobs with the trainer's. The weight-sync benchmark's trainer (`bench/weight_sync_trainer.py`)
uses `connect` and `perturb_weights` from here."""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from megatron_rl.config import LoraConfig
from megatron_rl.models import sharding
from megatron_rl.models.naming import canonical_name
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.rollout.engine import GenerationRequest
from megatron_rl.rollout.ray_utils import join_ray
from megatron_rl.trainer.hf_weights import local_offsets, local_tensors, rule_for, tp_coords
from megatron_rl.trainer.logprobs import forward_logprobs
from megatron_rl.trainer.lora import add_lora, init_adapter_weights
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.verify.parity import parity_tokens
from megatron_rl.weights.sync import EngineHandle, TrainerWeightSync, ray_get_named
from megatron_rl.workers import run_worker


def perturb_weights(rank, seed: int, scale: float) -> None:
    """Add seeded noise to every parameter, identical on every replica: it is drawn at full size and sharded."""

    table = rank.family.rule_table(rank.arch)
    layer_offset, expert_offset = local_offsets(rank.model, rank.ctx, rank.arch)
    with torch.no_grad():
        for local, tensor in local_tensors(rank.model).items():
            canonical = canonical_name(local, layer_offset, expert_offset)
            rule = rule_for(table, canonical, rank.arch)
            size, tp_rank = tp_coords(rule, rank.ctx)
            shape = list(tensor.shape)
            if rule.tp_dim is not None:
                shape[rule.tp_dim] *= size
            key = (
                "embedding.word_embeddings.weight"
                if canonical == "output_layer.weight" and rank.arch.tie_word_embeddings
                else canonical
            )
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            noise = torch.randn(shape, generator=gen, dtype=torch.float32)
            tensor.add_(sharding.shard(noise, rule, size, tp_rank).to(tensor.device, tensor.dtype) * scale)


def trainer_logprobs_on_rank0(rank, tokens: torch.Tensor) -> torch.Tensor | None:
    """Trainer logprobs of `tokens`, moved to rank 0 (they are computed on the last pipeline stage)."""

    logprobs = forward_logprobs(rank.model, rank.ctx, tokens)
    holder = [logprobs.cpu() if logprobs is not None and rank.ctx.tp_rank == 0 and rank.ctx.dp_rank == 0 else None]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, holder[0])
    return next(x for x in everyone if x is not None) if rank.ctx.rank == 0 else None


def engine_diffs(handles, tokens: torch.Tensor, reference: torch.Tensor, timeout_s: float) -> dict:
    """Per engine: max and mean |logprob difference| of the engines' scores of `tokens` against `reference`."""

    futures = {h.name: h.actor.score.remote(tokens.tolist()) for h in handles}
    scores = ray_get_named(futures, timeout_s, "scoring")
    out = {}
    for name, rows in scores.items():
        diff = (torch.tensor(rows, dtype=torch.float64) - reference.double()).abs()
        out[name] = {"max": float(diff.max()), "mean": float(diff.mean()), "tokens": int(diff.numel())}
    return out


def submit_inflight(handles, count: int, max_tokens: int, vocab: int) -> list:
    """Start `count` long generations spread over the engines (they will be in flight during the sync)."""

    gen = torch.Generator().manual_seed(7)
    refs = []
    for i in range(count):
        prompt = torch.randint(3, vocab, (16,), generator=gen).tolist()
        request = GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        refs.append(handles[i % len(handles)].actor.generate.remote(request))
    return refs


def wait_until_running(handles, count: int, timeout_s: float) -> None:
    """Block until the engines are generating `count` requests (so they are really in flight during the sync)."""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(ray.get([h.actor.running_requests.remote() for h in handles], timeout=30)) >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the {count} in-flight requests did not start within {timeout_s:.0f} s")


def summarize_inflight(results, max_tokens: int) -> dict:
    """How many in-flight requests finished whole, how many spanned two versions, how many were continued."""
    return {
        "requests": len(results),
        "complete": sum(len(r.token_ids) == max_tokens for r in results),
        "spanning_versions": sum(len(set(r.versions)) > 1 for r in results),
        "ordered_versions": sum(
            len(r.versions) == len(r.token_ids) and r.versions == sorted(r.versions) for r in results
        ),
        "continued": sum(r.continuations > 0 for r in results),
        "tokens": sum(len(r.token_ids) for r in results),
    }


def connect(spec: dict) -> tuple:
    """This rank's trainer at the spec's layout, the engines' handles (actors on rank 0) and the formed sync."""
    rank = bring_up_from_hf(spec["hf"], ParallelLayout(**spec["layout"]))
    lora = LoraConfig(**spec["lora"]) if spec.get("lora") else None
    if lora is not None:  # adapters on the loaded base: an adapter-only sync (the engines hold W0 already)
        add_lora(rank.model, lora, rank.family, rank.arch, rank.ctx, seed=0)
    if rank.ctx.rank == 0:
        join_ray(spec["ray_address"])
    handles = [
        EngineHandle(name, ray.get_actor(name) if rank.ctx.rank == 0 else None, workers)
        for name, workers in spec["engines"]
    ]
    sync = TrainerWeightSync(
        rank, handles, spec["bucket_bytes"], spec["timeout_s"], inflight=spec["inflight"], streams=spec["streams"],
        owner_aware=spec.get("owner_aware", True), lora_scale=lora.scale if lora is not None else None,
    )  # fmt: skip
    return rank, handles, sync, sync.setup()


def one_sync(rank, handles, sync, spec: dict, version: int, tokens: torch.Tensor) -> dict:
    """Change the weights (with LoRA: draw new adapters, B non-zero), push them as `version` (with requests in
    flight when asked), and compare (rank 0)."""
    if spec.get("lora"):
        init_adapter_weights(rank.model, rank.ctx, rank.arch, seed=version, b_std=spec["lora_b_std"])
    else:
        perturb_weights(rank, seed=version, scale=spec["noise"])
    reference = trainer_logprobs_on_rank0(rank, tokens)
    is_rank0 = rank.ctx.rank == 0
    entry: dict = {"version": version}
    inflight = []
    if is_rank0:
        entry["before"] = engine_diffs(handles, tokens, reference, spec["timeout_s"])
        inflight = submit_inflight(handles, spec["inflight_requests"], spec["inflight_tokens"], rank.arch.vocab_size)
        if inflight:
            wait_until_running(handles, spec["inflight_requests"], spec["timeout_s"])
        if spec.get("kill_engine") and version == spec["syncs"]:
            ray.kill(next(h.actor for h in handles if h.name == spec["kill_engine"]))
    dist.barrier()
    pushed = sync.push(version)
    sent: list = [None] * dist.get_world_size()
    dist.all_gather_object(sent, pushed["sent"].get("bytes", 0))
    entry["sent_bytes"] = sum(sent)  # every sender's buckets, each counted once
    if is_rank0:
        engines = pushed["engines"]
        entry["sync_seconds"] = pushed["seconds"]
        entry["engines"] = {name: r["version"] for name, r in engines.items()}
        entry["received_in_place"] = {
            name: sum(w.get("in_place", 0) for w in r["workers"]) for name, r in engines.items()
        }
        entry["received_bytes"] = received_per_worker(engines)
        entry["lora"] = {  # adapter-only syncs: what each engine serves (vllm mode) and its workers' reports
            name: {"served": r.get("lora"), "workers": [w.get("lora") for w in r["workers"]]}
            for name, r in engines.items()
        }
        entry["after"] = engine_diffs(handles, tokens, reference, spec["timeout_s"])
        results = ray.get(inflight, timeout=spec["timeout_s"]) if inflight else None
        entry["inflight"] = summarize_inflight(results, spec["inflight_tokens"]) if results else None
        entry["versions_reported"] = {h.name: ray.get(h.actor.weight_version.remote(), timeout=30) for h in handles}
    dist.barrier()
    return entry


def received_per_worker(engine_reports: dict[str, dict]) -> dict[str, int]:
    """`engine/worker<rank in its weight groups>` -> bytes that worker received in the update (only the workers
    vLLM returned reports of: the first data-parallel replica's)."""
    return {
        f"{name}/worker{w.get('member', i)}": w["bytes"]
        for name, report in engine_reports.items()
        for i, w in enumerate(report["workers"])
    }


def check(spec: dict, _startup_s: float) -> None:
    """The whole check; rank 0 writes the report."""
    rank, handles, sync, setup = connect(spec)
    tokens = parity_tokens(rank.arch.vocab_size, spec["batch"], spec["seq"], seed=11)
    syncs = [one_sync(rank, handles, sync, spec, v, tokens) for v in range(1, spec["syncs"] + 1)]
    report = {"plan": setup, "syncs": syncs}
    if rank.ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps(report))


if __name__ == "__main__":
    run_worker(check)
