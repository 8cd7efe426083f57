"""Benchmark: HF -> Megatron conversion throughput vs plainly reading and writing the same tensors.

Prints one JSON object. The ratio compares the workers' own conversion time (model build, reads, resharding,
distributed-checkpoint write; the slowest rank) with a plain safetensors read + write of the same bytes in the
same run; `wall_seconds` adds process launch and imports, reported beside it. The workers import Megatron and
join the process group before they start their clocks; `untimed_startup_seconds_rank0` shows that part.

    .venv/bin/python bench/convert.py [--layers 5] [--hidden 1024] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from megatron_rl.models.tiny import make_tiny
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.weights.convert import hf_to_mcore


def plain_read_write(hf_dir: Path, scratch: Path) -> float:
    """Seconds to load every tensor with safetensors and write them all back out (fsync'd)."""
    start = time.perf_counter()
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        out = scratch / path.name
        save_file(tensors, str(out))
        with open(out, "rb+") as handle:
            import os

            os.fsync(handle.fileno())
    return time.perf_counter() - start


def main() -> None:
    """Make a >= 500 MB Qwen3-MoE checkpoint, convert it at TP2xEP2, and time a plain read+write of it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mrl-bench-convert-") as tmp:
        root = Path(tmp)
        hf = make_tiny(
            "qwen3_moe",
            root / "hf",
            overrides={
                "hidden_size": args.hidden,
                "num_hidden_layers": args.layers,
                "num_attention_heads": args.hidden // 128,
                "num_key_value_heads": 2,
                "head_dim": 128,
                "moe_intermediate_size": args.hidden,
                "intermediate_size": 2 * args.hidden,
                "num_experts": args.experts,
            },
        )
        nbytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        (root / "plain").mkdir()
        plain_s = plain_read_write(hf, root / "plain")
        shutil.rmtree(root / "plain")
        report = hf_to_mcore(str(hf), str(root / "mcore"), ParallelLayout(tp=2, ep=2))
        convert_s = report["convert_seconds"]
        gbps = nbytes / convert_s / 1e9
        plain_gbps = nbytes / plain_s / 1e9
        print(
            json.dumps(
                {
                    "bytes": nbytes,
                    "layout": report["layout"],
                    "seconds": round(convert_s, 3),
                    "gb_per_s": round(gbps, 3),
                    "wall_seconds": round(report["wall_seconds"], 3),
                    "wall_gb_per_s": round(nbytes / report["wall_seconds"] / 1e9, 3),
                    "plain_seconds": round(plain_s, 3),
                    "plain_gb_per_s": round(plain_gbps, 3),
                    "ratio": round(gbps / plain_gbps, 3),
                    "phases_rank0": {
                        k: v
                        for k, v in report.items()
                        if k.endswith("_seconds") and k not in ("convert_seconds", "wall_seconds", "startup_seconds")
                    },
                    "untimed_startup_seconds_rank0": report.get("startup_seconds"),
                    "goal_ratio": 0.5,
                }
            )
        )


if __name__ == "__main__":
    main()
