"""Benchmark: the learner's train step (`train_batch`: one decoupled-PPO update of one batch) at the
quickstart's layout (EP2 on two gloo ranks) under several micro-batch settings, on three workloads. Prints one
JSON object: each setting's median step seconds, its optimizer share, micro-batches, token fill, and the ratio
to `micro_batch_size` 8 (the quickstart's old setting) within the same run.

    .venv/bin/python bench/train_step.py [--steps 10] [--workloads quickstart,compute,variable]

Every batch is 8 count-task prompts x 8 samples with random response tokens. `quickstart`: the 4-layer tiny
Qwen3-MoE (hidden 128), responses of up to 8 tokens, most of them full (little padding). `compute`: the same
batch on a 4-layer hidden-512 model, where the matmuls, not per-micro-batch overhead, take the time.
`variable`: the tiny model with responses of 1..64 tokens (uniform): half the padded batch is padding, what
packing removes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from megatron_rl.models.tiny import make_tiny
from megatron_rl.parallel.torchrun import run_torchrun

WORKER = "bench.train_step_worker"
TINY = {"num_hidden_layers": 4}  # the peer-comparison model: 4 layers, hidden 128, 8 experts top-2
WIDE = {"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
WORKLOADS = {
    "quickstart": {"model": TINY, "new_tokens": 8, "full_share": 0.75},
    "compute": {"model": WIDE, "new_tokens": 8, "full_share": 0.75},
    "variable": {"model": TINY, "new_tokens": 64, "full_share": 0.0},
}
SETTINGS = {
    "mbs8": {"size": 8},
    "mbs32": {"size": 32},
    "tokens4096": {"size": 8, "tokens": 4096},
    "packed4096": {"size": 8, "tokens": 4096, "pack": True},
    "packed_mbs8": {"size": 8, "pack": True},
}
BASELINE = "mbs8"


def run_step_worker(hf: Path, work: Path, ep: int, workload: dict, settings: dict, warmup: int, steps: int) -> dict:
    """The worker's report (`train_step_worker.run`) for `settings` on 8 x 8 quickstart-like sequences of
    `workload`'s response length and fill, at EP `ep` on as many gloo ranks; spec and log go to folder `work`."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # the workers import `bench.*`
        os.environ["PYTHONPATH"] = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    work.mkdir(parents=True, exist_ok=True)
    spec = {"hf": str(hf), "layout": {"ep": ep}, "prompts": 8, "samples": 8, "new_tokens": workload["new_tokens"],
            "full_share": workload["full_share"], "warmup": warmup, "steps": steps, "settings": settings,
            "out": str(work / "report.json")}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    run_torchrun(WORKER, [str(work / "spec.json")], ep, timeout_s=900, log_path=work / "log.txt")
    return json.loads((work / "report.json").read_text())


def main() -> None:
    """Run every workload's settings and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--ep", type=int, default=2)
    args = parser.parse_args()
    out = {"layout": f"ep{args.ep}", "steps": args.steps, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="mrl-bench-step-") as tmp:
        for name in args.workloads.split(","):
            work = WORKLOADS[name]
            hf = make_tiny("qwen3_moe", Path(tmp) / name, seed=0, overrides=work["model"])
            report = run_step_worker(hf, Path(tmp) / name, args.ep, work, SETTINGS, args.warmup, args.steps)
            base = report["settings"][BASELINE]["step_s"]
            for row in report["settings"].values():
                row["vs_mbs8"] = round(row["step_s"] / base, 3)
            out["workloads"][name] = report
    print(json.dumps(out))


if __name__ == "__main__":
    main()
