"""torchrun worker of the train-step benchmark (`train_step.py` runs it as `-m bench.train_step_worker SPEC`):
the learner's `train_batch` on the same quickstart-like batch under each micro-batch setting, timed after
warm-up steps, with a split of the forward-backward and the optimizer step. Rank 0 writes the report to `out`.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.config import AlgorithmConfig, OptimizerConfig
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.rollout.tasks import CountTask, load_tokenizer
from megatron_rl.trainer import train_step as train_step_module
from megatron_rl.trainer.batch import TrainBatch, replica_share
from megatron_rl.trainer.learner import train_batch
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.optimizer import build_training
from megatron_rl.trainer.packing import MicroBatching
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.trainer.train_step import loss_spec
from megatron_rl.workers import run_worker


def quickstart_batch(
    hf: str, prompts: int, samples: int, new_tokens: int, seed: int, full_share: float = 0.75
) -> TrainBatch:
    """`prompts` x `samples` count-task prompts with random responses of 1..`new_tokens` tokens (a share
    `full_share` of them full, as a policy that has learned the task writes; the rest uniform), random rewards,
    GRPO advantages; right-padded."""
    gen = torch.Generator().manual_seed(seed)
    task = CountTask(load_tokenizer(hf))
    rows = []
    for record, _ in zip(task.prompts(), range(prompts)):
        for _ in range(samples):
            n = (
                new_tokens
                if torch.rand(1, generator=gen) < full_share
                else int(torch.randint(1, new_tokens, (1,), generator=gen))
            )
            rows.append((record["prompt_ids"], torch.randint(3, 500, (n,), generator=gen).tolist()))
    seq = max(len(p) + len(r) for p, r in rows)
    seq += seq % 2
    tokens = torch.zeros(len(rows), seq, dtype=torch.long)
    mask = torch.zeros(len(rows), seq - 1)
    for i, (p, r) in enumerate(rows):
        tokens[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
    rewards = torch.rand(len(rows), generator=gen, dtype=torch.float64)
    groups = torch.arange(len(rows)) // samples
    return TrainBatch(
        tokens=tokens, loss_mask=mask, behaviour_logprobs=-3.0 * mask,
        advantages=compute_advantages("grpo", rewards, group_ids=groups).float(),
        lengths=torch.tensor([len(p) + len(r) for p, r in rows]), rewards=rewards, group_ids=groups,
    )  # fmt: skip


@contextmanager
def timed_optimizer(times: list[float]):
    """Time each guarded optimizer step (gradient norm, clip, Adam) of the block into `times`."""
    original = train_step_module._guarded_optimizer_step

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    train_step_module._guarded_optimizer_step = wrapped
    try:
        yield
    finally:
        train_step_module._guarded_optimizer_step = original


def run(spec: dict, rank) -> dict:
    """Every setting's median step time on the same batch, from the same weights."""
    ctx = rank.ctx
    algo = AlgorithmConfig(loss="decoupled_ppo", correction="tis", is_cap=2.0)
    spec_loss = loss_spec(algo, max_new_tokens=spec["new_tokens"])
    batch = quickstart_batch(
        spec["hf"], spec["prompts"], spec["samples"], spec["new_tokens"], seed=0, full_share=spec["full_share"]
    )
    share = replica_share(batch, ctx.dp_rank, ctx.layout.data_parallel)
    optim = OptimizerConfig(lr=1e-5, clip_grad=1.0, adam_beta2=0.99)
    state = build_training(rank.model, optim, 10_000)
    report = {
        "new_tokens": spec["new_tokens"],
        "full_share": spec["full_share"],
        "sequences": batch.batch_size,
        "padded_length": batch.seq_len,
        "real_tokens": int(batch.lengths.sum()),
    }
    results = {}
    for name, micro in spec["settings"].items():
        settings = MicroBatching(**micro)
        seconds, cpu, optimizer, stats = [], [], [], {}
        for i in range(spec["warmup"] + spec["steps"]):
            torch.distributed.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            with timed_optimizer(optimizer):
                stats = train_batch(state, ctx, share, algo, spec_loss, settings)
            if i >= spec["warmup"]:
                seconds.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
        opt = optimizer[spec["warmup"] :]
        # Every rank's median CPU seconds a step, summed: what the step costs the machine's cores.
        cpu_all = torch.tensor([statistics.median(cpu)], dtype=torch.float64)
        torch.distributed.all_reduce(cpu_all)
        results[name] = {
            "step_s": round(statistics.median(seconds), 4),
            "cpu_s_all_ranks": round(float(cpu_all), 4),
            "optimizer_s": round(statistics.median(opt), 4),
            "micro_batches": stats["batch/micro_batches"],
            "token_fill": round(stats["batch/token_fill"], 3),
        }
    report["settings"] = results
    return report


def main(spec: dict, _startup_s: float) -> None:
    """Bring the trainer up at the spec's layout, run, and let rank 0 write the report."""
    layout = ParallelLayout(**spec["layout"])
    rank = bring_up_from_hf(spec["hf"], layout, BuildOptions(init_weights=False, moe_aux_loss_coeff=0.0))
    report = run(spec, rank)
    if rank.ctx.rank == 0:
        Path(spec["out"]).write_text(json.dumps(report))


if __name__ == "__main__":
    run_worker(main)
