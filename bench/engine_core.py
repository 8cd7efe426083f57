"""Benchmark: vLLM's AsyncLLM with its engine core in a process of its own (vLLM's way) or in the caller's process
(`rollout/vllm_inproc.py`, the CPU engines' default), on the quickstart's generation.

    .venv/bin/python bench/engine_core.py [--rounds 20] [--layers 4]

Each mode runs in a child process of its own, set up as a CPU engine of ours (one OpenMP thread, threads left
unbound, eager, fp32, processed logprobs, one seeded request per sample with a delta per token, handed over as
`rollout/engine.py` hands them): 8 count-task prompts x 8 samples x 8 new tokens per round, 3 warm-up rounds, then
`--rounds` timed ones. Printed (one JSON object): per mode the seconds per round and the CPU seconds per round of
the child and every process it started (the engine core's, in vLLM's way), and the ratios in-process / own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _proc import tree_cpu_s  # beside this file

from megatron_rl.models.tiny import make_tiny
from megatron_rl.rollout.tasks import CountTask, load_tokenizer

PROMPTS, SAMPLES, NEW_TOKENS, WARMUP = 8, 8, 8, 3


def start_llm(hf: str, in_process: bool):
    """(Child) an AsyncLLM set up as our CPU engines set theirs up, and the quickstart's prompts of one round (each
    prompt once per sample)."""
    from vllm import AsyncEngineArgs  # the child only: vLLM sets its process's threads

    from megatron_rl.rollout.vllm_inproc import AsyncLLM, in_process_async_llm  # imports vLLM: as above

    args = AsyncEngineArgs(model=hf, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=64,
                           seed=0, disable_log_stats=True, logprobs_mode="processed_logprobs",
                           enable_prefix_caching=False)  # fmt: skip
    llm = in_process_async_llm(args) if in_process else AsyncLLM.from_engine_args(args)
    stream = CountTask(load_tokenizer(Path(hf))).prompts()
    return llm, [r["prompt_ids"] for r, _ in zip(stream, range(PROMPTS)) for _ in range(SAMPLES)]


def child_env() -> dict:
    """The environment of a benchmark child: one OpenMP thread, threads unbound, vLLM's logs on stderr."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # fmt: skip


def round_runner(llm, prompts: list[list[int]], rendered: bool = True, own_params: bool = True):
    """(Child) an async function generating one round on `llm` and returning its token count: one seeded request
    per sample, a delta per token, each request's SamplingParams its own (`own_params`: vLLM takes them without a
    deep copy) and its prompt vLLM's rendered token input (`rendered`), as `rollout/engine.py` hands them over."""
    from vllm import SamplingParams  # the child only: vLLM sets its process's threads
    from vllm.inputs.engine import tokens_input  # as above
    from vllm.sampling_params import RequestOutputKind  # as above

    calls = iter(range(10**9))

    async def one(seed: int, ids: list[int]) -> int:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0, detokenize=False,
                                ignore_eos=True, seed=seed, output_kind=RequestOutputKind.DELTA,
                                skip_clone=own_params)  # fmt: skip
        tokens = 0
        prompt = tokens_input(list(ids)) if rendered else {"prompt_token_ids": list(ids)}
        async for out in llm.generate(prompt, params, f"r{next(calls)}"):
            tokens += len(out.outputs[0].token_ids)
        return tokens

    async def round_() -> int:
        return sum(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))

    return round_


async def child(hf: str, in_process: bool, rounds: int) -> dict:
    """(Child) time `rounds` rounds of the quickstart's generation on one AsyncLLM."""
    llm, prompts = start_llm(hf, in_process)
    round_ = round_runner(llm, prompts)

    for _ in range(WARMUP):
        await round_()
    cpu, start = tree_cpu_s(), time.perf_counter()
    tokens = sum([await round_() for _ in range(rounds)])
    report = {"s": (time.perf_counter() - start) / rounds, "cpu_s": (tree_cpu_s() - cpu) / rounds}
    llm.shutdown()
    assert tokens == rounds * PROMPTS * SAMPLES * NEW_TOKENS, tokens
    return {k: round(v, 4) for k, v in report.items()}


def run_child(hf: Path, in_process: bool, rounds: int) -> dict:
    """One mode in a fresh child process; its report."""
    env = child_env()
    mode = "--child-in-process" if in_process else "--child-own-process"
    cmd = [sys.executable, __file__, mode, str(hf), "--rounds", str(rounds)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    """Time both modes and print them with their ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child-in-process", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-own-process", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_in_process or args.child_own_process:
        hf, in_process = args.child_in_process or args.child_own_process, bool(args.child_in_process)
        print(json.dumps(asyncio.run(child(hf, in_process, args.rounds))), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="mrl-bench-engine-core-") as tmp:
        hf = make_tiny("qwen3_moe", Path(tmp) / "model", seed=0, overrides={"num_hidden_layers": args.layers})
        own = run_child(hf, False, args.rounds)
        inproc = run_child(hf, True, args.rounds)
    print(json.dumps({
        "layers": args.layers, "rounds": args.rounds, "own_process": own, "in_process": inproc,
        "s_ratio_in_over_own": round(inproc["s"] / own["s"], 3),
        "cpu_ratio_in_over_own": round(inproc["cpu_s"] / own["cpu_s"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
