"""Torchrun worker of tests/distributed/test_top_kl.py: the top-k KL term on vocab-parallel logits at TP2 (each
rank half the vocabulary) against the same term on the whole logits in one process, values and gradients."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megatron_rl.algorithms.distill import top_k_kl
from megatron_rl.parallel.groups import destroy_distributed, init_distributed
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.processes import enable_stack_dumps
from megatron_rl.trainer.logprobs import vocab_parallel_logprobs_at

VOCAB, K = 64, 5


def main(out: str) -> None:
    """Compare the sharded and the whole computation; rank 0 writes the largest differences to `out`."""
    enable_stack_dumps()  # a hung worker's stacks reach the log before run_torchrun kills it
    ctx = init_distributed(ParallelLayout(tp=2), timeout_s=120)
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(2, 6, VOCAB, generator=gen) * 3
    ids = torch.randint(0, VOCAB, (2, 6, K), generator=gen)  # ids on both halves of the vocabulary
    teacher = torch.randn(2, 6, K, generator=gen).log_softmax(-1)
    width = VOCAB // 2
    mine = full[..., ctx.tp_rank * width : (ctx.tp_rank + 1) * width].clone().requires_grad_()
    report = {}
    for kind in ("forward", "reverse"):
        sharded = top_k_kl(vocab_parallel_logprobs_at(mine, ids), teacher, kind)
        (grad,) = torch.autograd.grad(sharded.sum(), mine)
        whole = full.clone().requires_grad_()
        reference = top_k_kl(torch.gather(whole.log_softmax(-1), -1, ids), teacher, kind)
        (ref_grad,) = torch.autograd.grad(reference.sum(), whole)
        ref_mine = ref_grad[..., ctx.tp_rank * width : (ctx.tp_rank + 1) * width]
        diffs = torch.tensor([(sharded - reference).abs().max(), (grad - ref_mine).abs().max()])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        report[kind] = {"value": float(diffs[0]), "grad": float(diffs[1]), "kl_mean": float(reference.mean())}
    logprobs = vocab_parallel_logprobs_at(mine.detach(), ids)
    report["logprob"] = float((logprobs - torch.gather(full.log_softmax(-1), -1, ids)).abs().max())
    if ctx.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
