"""Benchmark: what handing a request to vLLM costs the engine, the three ways against each other on one in-process
engine set up as ours (`bench/engine_core.py`'s child): vLLM's defaults (a raw token prompt, which vLLM renders in
a worker thread, and SamplingParams it deep-copies), the raw prompt with each request's own SamplingParams
(`skip_clone`), and the engine's way (vLLM's rendered token input and own SamplingParams).

    .venv/bin/python bench/engine_requests.py [--rounds 40] [--layers 4]

Rounds of the quickstart's generation (8 count-task prompts x 8 samples x 8 new tokens, one seeded request per
sample) alternate between the three ways in one process, so a drift of the machine's speed hits each alike; 2
warm-up rounds of each first. Printed (one JSON object): each way's median CPU milliseconds per round (every
thread of the process: the engine core runs in it) and the ratios to vLLM's defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from engine_core import child_env, round_runner, start_llm  # beside this file

from megatron_rl.models.tiny import make_tiny

WAYS = {"vllm_defaults": (False, False), "own_params": (False, True), "ours": (True, True)}
"""Each way: (rendered prompt, own SamplingParams)."""


async def measure(hf: str, rounds: int) -> dict:
    """Median CPU milliseconds per round of each way, interleaved."""
    llm, prompts = start_llm(hf, in_process=True)
    runners = {way: round_runner(llm, prompts, *flags) for way, flags in WAYS.items()}
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for i in range(rounds + 2):
            for way, run in runners.items():
                start = time.process_time()
                await run()
                if i >= 2:
                    cpu[way].append(1000 * (time.process_time() - start))
    finally:
        llm.shutdown()
    return {way: round(statistics.median(values), 2) for way, values in cpu.items()}


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    os.environ.update(child_env())  # before vLLM is imported (start_llm imports it)
    with tempfile.TemporaryDirectory(prefix="mrl-bench-engine-requests-") as tmp:
        hf = make_tiny("qwen3_moe", Path(tmp) / "model", seed=0, overrides={"num_hidden_layers": args.layers})
        cpu_ms = asyncio.run(measure(str(hf), args.rounds))
    base = cpu_ms["vllm_defaults"]
    print(json.dumps({
        "layers": args.layers, "rounds": args.rounds, "cpu_ms_per_round": cpu_ms,
        "ratio_to_vllm_defaults": {way: round(ms / base, 3) for way, ms in cpu_ms.items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
