"""`megatron-rl verify sync`: trainer at a layout -> changed weights -> bucketed sync to vLLM engines -> logprobs.

The driver starts a local Ray and the engine pool, then launches the trainer under torchrun; the trainer's rank
0 joins Ray to reach the engines.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from megatron_rl.models import family_for_hf_config, read_hf_config
from megatron_rl.parallel.layout import ParallelLayout, check_layout_fits_model
from megatron_rl.parallel.torchrun import run_torchrun
from megatron_rl.rollout.engine import EngineSpec
from megatron_rl.rollout.pool import EnginePool
from megatron_rl.rollout.ray_utils import start_local_ray
from megatron_rl.weights.transport import GLOO_STREAMS

WORKER = "megatron_rl.workers.sync_check"


def run_sync_check(
    hf_dir: str,
    layout: ParallelLayout,
    engines: int = 2,
    engine_tp: int | list[int] = 1,
    engine_ep: bool | list[bool] = False,
    engine_dp: int = 1,
    owner_aware: bool = True,
    syncs: int = 1,
    bucket_mb: float = 64,
    inflight: str = "keep",
    inflight_requests: int = 0,
    inflight_tokens: int = 256,
    noise: float = 0.02,
    batch: int = 4,
    seq: int = 160,
    timeout_s: float = 300.0,
    kill_engine: str | None = None,
    lora: dict | None = None,
    lora_b_std: float = 0.05,
    enforce_eager: bool | None = None,
) -> dict:
    """Run the check and return the report (the last sync's figures at top level, every sync under `syncs`).

    `engine_tp` may list one size per engine; `engine_ep` (one flag, or one per engine) turns vLLM's expert
    parallelism on over an engine's tp x `engine_dp` workers, and `owner_aware` (default) sends each expert only to the workers that host it
    (else every tensor is broadcast to every worker). `kill_engine` (fault injection) kills that engine's actor
    right before the last sync, which must then fail within `timeout_s` naming it. `lora` (LoraConfig fields):
    the trainer gets adapters on the checkpoint's base and each sync draws new ones (B normal(0, `lora_b_std`))
    and sends only them (adapter-only sync, merged by the engines onto their W0; with `sync: vllm` served as a
    vLLM LoRA adapter instead). `enforce_eager`: the engines' vLLM mode (`EngineSpec.enforce_eager`; None: its
    default), reported per engine as `engine_eager`.
    """

    hf_config = read_hf_config(hf_dir)
    family = family_for_hf_config(hf_config, where=f"{hf_dir}/config.json")
    check_layout_fits_model(layout, family.arch_from_hf(hf_config, f"{hf_dir}/config.json"))
    ray_info = start_local_ray()
    tps = engine_tp if isinstance(engine_tp, list) else [engine_tp] * engines
    eps = engine_ep if isinstance(engine_ep, list) else [engine_ep] * engines
    if len(tps) != engines or len(eps) != engines:
        raise ValueError(f"engine_tp lists {len(tps)} sizes and engine_ep {len(eps)} flags for {engines} engines")
    specs = [
        EngineSpec(
            f"engine-{i}",
            str(hf_dir),
            dtype="float32",
            tensor_parallel=tps[i],
            data_parallel=engine_dp,
            expert_parallel=eps[i],
            max_model_len=1024,
            seed=i,
            lora_rank=lora["rank"] if lora and lora.get("sync") == "vllm" else 0,
            enforce_eager=enforce_eager,
        )
        for i in range(engines)
    ]
    pool = EnginePool(specs, cpus_per_engine=0.5)
    try:
        health = pool.start(max(300.0, timeout_s))  # start-up is not what the sync timeout bounds
        with tempfile.TemporaryDirectory(prefix="mrl-sync-") as tmp:
            spec = {
                "hf": str(hf_dir), "layout": layout.__dict__, "ray_address": ray_info["address"],
                "engines": [[h.name, h.workers] for h in pool.handles()], "bucket_bytes": int(bucket_mb * (1 << 20)),
                "streams": GLOO_STREAMS, "timeout_s": timeout_s, "inflight": inflight, "syncs": syncs, "noise": noise, "batch": batch, "seq": seq,
                "inflight_requests": inflight_requests, "inflight_tokens": inflight_tokens,
                "kill_engine": kill_engine, "owner_aware": owner_aware, "lora": lora, "lora_b_std": lora_b_std,
                "out": str(Path(tmp) / "report.json"),
            }  # fmt: skip
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            run_torchrun(WORKER, [str(Path(tmp) / "spec.json")], layout.world_size, timeout_s * (syncs + 2))
            report = json.loads(Path(spec["out"]).read_text())
    finally:
        pool.shutdown()
    report["engine_dp"] = engine_dp
    eager = {h["engine"]: h["eager"] for h in health}
    return {"engine_eager": eager} | summarize(
        report, family.name, layout, engines, tps, eps if isinstance(engine_ep, list) else engine_ep
    )


def summarize(
    report: dict, family: str, layout: ParallelLayout, engines: int, engine_tp: list[int], engine_ep: bool | list
) -> dict:
    """Top-level figures from the worker's per-sync report; `received_bytes` is what each engine worker received
    in the last sync (the plan's own figure per weight-group rank: `planned_received_bytes`), beside the
    non-expert and expert payload."""
    last = report["syncs"][-1]
    first = report["syncs"][0]
    plan = report["plan"]
    return {
        "family": family,
        "layout": layout.describe(),
        "engines": engines,
        "engine_tp": engine_tp,
        "engine_dp": report.get("engine_dp", 1),
        "engine_ep": engine_ep,
        "owner_aware": plan.get("owner_aware", False),
        "hosted": plan.get("hosted", {}),
        "expert_bytes": plan.get("expert_payload_bytes", 0),
        "non_expert_bytes": plan["payload_bytes"] - plan.get("expert_payload_bytes", 0),
        "received_bytes": last.get("received_bytes", {}),
        "planned_received_bytes": plan.get("received_bytes", {}),
        "num_tokens": min(e["tokens"] for e in last["after"].values()),
        "max_abs_logprob_diff": max(e["max"] for e in last["after"].values()),
        "mean_abs_logprob_diff": max(e["mean"] for e in last["after"].values()),
        "max_abs_logprob_diff_before_sync": min(e["max"] for e in first["before"].values()),
        "bytes": report["plan"]["payload_bytes"],
        "buckets": report["plan"]["buckets"],
        "sync_seconds": last["sync_seconds"],
        "sent_bytes_per_sync": [s["sent_bytes"] for s in report["syncs"]],
        "version": min(last["versions_reported"].values()),
        "versions_per_sync": [s["versions_reported"] for s in report["syncs"]],
        "received_in_place_per_sync": [s["received_in_place"] for s in report["syncs"]],
        "inflight": [s["inflight"] for s in report["syncs"]],
        "syncs": report["syncs"],
    }
