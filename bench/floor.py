"""Benchmark: the compute floor of one quickstart step on this machine, which the peer comparison
(`peer_trl.py`) reads against. Each part of a step is timed alone, on an otherwise idle machine, on the peer
comparison's model (the random 4-layer Qwen3-MoE of seed 0) and a quickstart batch (8 count prompts x 8 samples,
8 new tokens, `train_step_worker.quickstart_batch`):

    .venv/bin/python bench/floor.py [--steps 10] [--size tiny|wide] [--compiled]

`--size wide`: the same on `train_step.py`'s compute model (hidden 512, 8 heads x 64), where the matmuls, not
per-op costs, take the time.

- `hf_update_share_1t`: transformers' forward, backward and AdamW step on one trainer rank's share (half the
  batch) on one thread: the least a rank of the EP2 trainer computes.
- `hf_update_whole_2t`: the same on the whole batch with two threads (what TRL's update computes).
- `hf_generate_2t`: transformers' `generate` of the 64 completions, sampled, with two threads (TRL's).
- `vllm_generate_1t`: vLLM generating the same completions on one thread, set up as the quickstart's engine
  is (eager, its engine core in-process, prefix caching off, 64 requests each with its own seed); with
  `--compiled` also `vllm_generate_compiled_1t`, the same compiled (torch.compile). Both with their start-up
  seconds.
- `megatron_step_ep2`: our train step (`train_batch`, the quickstart's micro-batching) at EP2 on two gloo ranks;
  its `cpu_s` is both ranks' CPU seconds together.

Each as median seconds per step (`*_s`) and CPU seconds of this process per step (`*_cpu_s`). Derived:
`floor_disaggregated_s` = (two rank shares + the vLLM generation) / 2 cores, a step of our design with no
overhead at all and both cores always busy; `floor_sync_s` = TRL's update + generation in one process;
`megatron_step_over_hf_share` = how far our train step is above its compute floor;
`megatron_cpu_over_hf_shares` = the CPU seconds of our train step on both ranks over those of transformers'
update of the two halves (twice `hf_update_share_1t`): what Megatron-Core costs above transformers for the same
rows; `floor_ours_s` = (the CPU seconds of Megatron-Core's train step on both ranks + vLLM's generation) / 2
cores, the least a step of our two stacks as they are can take here, with nothing else (weight push, batch
hand-off, Ray, rewards) and no core ever idle; `floor_ours_over_sync` = that over `floor_sync_s` (at 1 or more,
overlap alone cannot beat TRL's way).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from train_step import SETTINGS, TINY, WIDE, WORKLOADS, run_step_worker
from train_step_worker import quickstart_batch
from transformers import AutoModelForCausalLM

from megatron_rl.models.tiny import make_tiny
from megatron_rl.rollout.tasks import CountTask, load_tokenizer

PROMPTS, SAMPLES, NEW_TOKENS = 8, 8, 8


def timed(fn: Callable[[], object], steps: int, warmup: int = 2) -> dict:
    """Median wall seconds and mean CPU seconds (this process, all threads) of `fn` per call."""
    for _ in range(warmup):
        fn()
    walls = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"s": round(statistics.median(walls), 4), "cpu_s": round(cpu / steps, 4)}


def prompt_ids(hf: Path) -> list[list[int]]:
    """The first count-task prompts' token ids."""
    return [r["prompt_ids"] for r, _ in zip(CountTask(load_tokenizer(hf)).prompts(), range(PROMPTS))]


def hf_update(hf: Path, rows: slice, threads: int, steps: int) -> dict:
    """transformers' forward + backward + AdamW on `rows` of the quickstart batch, on `threads` threads."""
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0)
    batch = quickstart_batch(str(hf), PROMPTS, SAMPLES, NEW_TOKENS, seed=0)
    tokens, mask, adv = batch.tokens[rows], batch.loss_mask[rows], batch.advantages[rows]
    attention = (torch.arange(tokens.shape[1]) < batch.lengths[rows, None]).long()

    def step():
        logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(logprobs * adv[:, None] * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    return timed(step, steps)


def hf_generate(hf: Path, threads: int, steps: int) -> dict:
    """transformers' sampled `generate` of PROMPTS x SAMPLES completions of NEW_TOKENS tokens (left-padded)."""
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    prompts = [p for p in prompt_ids(hf) for _ in range(SAMPLES)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": True, "pad_token_id": 0}
    return timed(lambda: model.generate(input_ids=ids, attention_mask=attention, **kwargs), steps)


def vllm_generate(hf: Path, steps: int, compiled: bool = False) -> dict:
    """vLLM's generation of the same completions, in a child process on one thread (vLLM sets its threads at
    start-up, so it cannot share this process with the transformers parts)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # fmt: skip
    cmd = [sys.executable, __file__, "--vllm-child", str(hf), "--steps", str(steps), *(["--compiled"] * compiled)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def vllm_child(hf: str, steps: int, compiled: bool) -> None:
    """(Child process) print `timed` of vLLM's generation, with its start-up seconds, as the last stdout line."""
    from vllm import LLM, SamplingParams  # the child only: vLLM sets its process's threads when it starts

    start = time.perf_counter()
    llm = LLM(model=hf, dtype="float32", enforce_eager=not compiled, max_model_len=256, max_num_seqs=256, seed=0,
              gpu_memory_utilization=0.5, disable_log_stats=True, logprobs_mode="processed_logprobs",
              enable_prefix_caching=False)  # fmt: skip
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(Path(hf)) for _ in range(SAMPLES)]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0, detokenize=False, ignore_eos=True,
                             seed=i) for i in range(len(prompts))]  # fmt: skip
    report = timed(lambda: llm.generate(prompts, params, use_tqdm=False), steps)
    print(json.dumps(report | {"startup_s": round(startup, 1)}), flush=True)


def megatron_step(hf: Path, steps: int, work: Path) -> dict:
    """Our train step at EP2 with the quickstart's micro-batching (`bench/train_step.py`'s `tokens4096`)."""
    settings = {"quickstart": SETTINGS["tokens4096"]}
    report = run_step_worker(hf, work / "step", 2, WORKLOADS["quickstart"], settings, warmup=3, steps=steps)
    row = report["settings"]["quickstart"]
    return {"s": row["step_s"], "cpu_s": row["cpu_s_all_ranks"]}


def main() -> None:
    """Time every part and print them with the floors they give."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", choices=("tiny", "wide"), default="tiny")
    parser.add_argument("--compiled", action="store_true", help="time vLLM's compiled mode too")
    parser.add_argument("--vllm-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_child:
        return vllm_child(args.vllm_child, args.steps, args.compiled)
    with tempfile.TemporaryDirectory(prefix="mrl-bench-floor-") as tmp:
        hf = make_tiny("qwen3_moe", Path(tmp) / "model", seed=0, overrides=TINY if args.size == "tiny" else WIDE)
        half = slice(0, PROMPTS * SAMPLES // 2)
        parts = {
            "hf_update_share_1t": hf_update(hf, half, 1, args.steps),
            "hf_update_whole_2t": hf_update(hf, slice(None), 2, args.steps),
            "hf_generate_2t": hf_generate(hf, 2, args.steps),
            "vllm_generate_1t": vllm_generate(hf, args.steps),
            "megatron_step_ep2": megatron_step(hf, args.steps, Path(tmp)),
        }
        if args.compiled:
            parts["vllm_generate_compiled_1t"] = vllm_generate(hf, args.steps, compiled=True)
    out = {"size": args.size, **{f"{name}_{k}": v for name, part in parts.items() for k, v in part.items()}}
    share, vllm = parts["hf_update_share_1t"]["s"], parts["vllm_generate_1t"]["s"]
    out["floor_disaggregated_s"] = round((2 * share + vllm) / 2, 4)
    out["floor_sync_s"] = round(parts["hf_update_whole_2t"]["s"] + parts["hf_generate_2t"]["s"], 4)
    out["floor_sync_over_disaggregated"] = round(out["floor_sync_s"] / out["floor_disaggregated_s"], 3)
    out["megatron_step_over_hf_share"] = round(parts["megatron_step_ep2"]["s"] / share, 3)
    hf_shares_cpu = 2 * parts["hf_update_share_1t"]["cpu_s"]
    out["megatron_cpu_over_hf_shares"] = round(parts["megatron_step_ep2"]["cpu_s"] / hf_shares_cpu, 3)
    out["floor_ours_s"] = round((parts["megatron_step_ep2"]["cpu_s"] + parts["vllm_generate_1t"]["cpu_s"]) / 2, 4)
    out["floor_ours_over_sync"] = round(out["floor_ours_s"] / out["floor_sync_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
