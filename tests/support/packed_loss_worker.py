"""Torchrun worker of tests/distributed/test_packed_loss.py: the train step's loss function on one micro-batch,
given the same logits padded (`[b, S, V]`) and packed (`[r, C, V]`, the sequences end to end), with every
per-token path on: the engines' sampling mask with their kept sets (some rows given, some recomputed), the
entropy bonus and distillation's top-k KL. Rank 0 writes the largest differences of the loss, the kept
per-token results and the logits' gradients (at the real positions), and how many positions' kept sets each
layout recomputed, to the report."""

from __future__ import annotations

import json
import sys
from unittest import mock

import torch

from megatron_rl.algorithms.sampling_mask import KEEP_ALL, SamplingMask, keep_mask
from megatron_rl.config import AlgorithmConfig
from megatron_rl.models.routes import KEPT_PAD
from megatron_rl.parallel.groups import destroy_distributed, init_distributed
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.processes import enable_stack_dumps
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.micro_batches import LossLayout
from megatron_rl.trainer.packing import packed_plan
from megatron_rl.trainer.train_step import Normalizers, _loss_func, loss_spec

VOCAB, SEQ, K, TOP = 48, 12, 8, 4
LENGTHS = [5, 12, 3, 7, 9, 4]
UNIDENTIFIED = 1
"""The row whose kept sets the engine could not identify."""


def make_batch(gen: torch.Generator) -> TrainBatch:
    """A right-padded micro-batch of random sequences of `LENGTHS` with response masks, advantages, behaviour
    and proximal logprobs, the engines' kept sets (row 1's unidentified) and a teacher's top-k."""
    rows = len(LENGTHS)
    tokens = torch.randint(1, VOCAB, (rows, SEQ), generator=gen)
    mask = torch.zeros(rows, SEQ - 1)
    for row, n in enumerate(LENGTHS):
        tokens[row, n:] = 0
        mask[row, 1 : n - 1] = 1  # a prompt of two tokens
    kept = torch.randint(0, VOCAB, (rows, SEQ - 1, K), generator=gen, dtype=torch.int32)
    kept[..., 0] = tokens[:, 1:]  # every label in its set
    kept[~mask.bool()] = KEPT_PAD  # as `batch_kept_sets` lays them out: positions nothing is trained on keep all
    kept[~mask.bool(), 0] = KEEP_ALL
    kept[UNIDENTIFIED][mask[UNIDENTIFIED].bool()] = KEPT_PAD  # recomputed from the logits
    return TrainBatch(
        tokens=tokens, loss_mask=mask, advantages=torch.randn(rows, generator=gen),
        behaviour_logprobs=-torch.rand(rows, SEQ - 1, generator=gen) * 4 * mask,
        proximal_logprobs=-torch.rand(rows, SEQ - 1, generator=gen) * 4 * mask,
        lengths=torch.tensor(LENGTHS), kept_tokens=kept,
        teacher_top_ids=torch.randint(0, VOCAB, (rows, SEQ - 1, TOP), generator=gen),
        teacher_top_logprobs=torch.randn(rows, SEQ - 1, TOP, generator=gen).log_softmax(-1),
    )  # fmt: skip


def main(out: str) -> None:
    """Both layouts through `_loss_func`; rank 0 writes the report."""
    enable_stack_dumps()  # a hung worker's stacks reach the log before run_torchrun kills it
    init_distributed(ParallelLayout(), timeout_s=120)
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(gen)
    algo = AlgorithmConfig(loss="decoupled_ppo", entropy_coef=0.05, kl_coef=0.0)
    spec = loss_spec(algo, sampling=SamplingMask(top_k=6, top_p=0.9), top_kl=("forward", 0.5), temperature=0.8)
    norms = Normalizers(policy=float(batch.loss_mask.sum()), input=float(batch.loss_mask.sum()))
    plan = packed_plan(batch.lengths, batch.tokens, count=1, width=SEQ)
    packed = plan.packed[0]
    mb = batch.select(plan.groups[0])
    logits = torch.randn(len(LENGTHS), SEQ, VOCAB, generator=gen) * 2
    padded_in = logits[plan.groups[0]].clone().requires_grad_()
    packed_in = packed.pack(logits[plan.groups[0]], 0.0, local=True).requires_grad_()
    report = {"rows": list(packed.shape), "padded_positions": len(LENGTHS) * SEQ}
    report["unidentified_positions"] = int(batch.loss_mask[UNIDENTIFIED].sum())
    results = {}
    recomputed = []  # positions whose kept set is recomputed from the full logits (a TP gather each, at scale)

    def counted(logits, top_k, top_p):
        recomputed[-1] += logits.shape[0]
        return keep_mask(logits, top_k, top_p)

    for name, layout, source in (("padded", LossLayout(), padded_in), ("packed", LossLayout(packed), packed_in)):
        recomputed.append(0)
        # `_loss_func` may overwrite its fp32 input in place (Megatron's cross entropy): hand it a copy.
        with mock.patch("megatron_rl.trainer.logprobs.keep_mask", counted):
            loss, kept = _loss_func(mb, spec, norms, 1.0, layout, source * 1.0)
        (grad,) = torch.autograd.grad(loss, source)
        results[name] = (loss, kept, layout.back(grad))
        if layout.packed is not None:  # the rows' tail padding is no sequence's: no gradient reaches it
            report["padding_grad"] = float(grad[packed.padding()].abs().max())
    (loss_a, kept_a, grad_a), (loss_b, kept_b, grad_b) = results["padded"], results["packed"]
    real = torch.arange(SEQ)[None, :] < mb.lengths[:, None]
    response = mb.loss_mask.bool()
    report["loss"] = [float(loss_a), float(loss_b)]
    for key in ("logprobs", "entropy", "top_kl"):
        report[key] = float((kept_a[key] - kept_b[key])[response].abs().max())
    report["outside_equal"] = bool(torch.equal(kept_a["outside"][response], kept_b["outside"][response]))
    report["outside_any"] = bool(kept_a["outside"][response].any())
    report["grad"] = float((grad_a - grad_b)[real].abs().max())
    report["grad_max"] = float(grad_a.abs().max())
    report["top_kl_mean"] = float(kept_a["top_kl"][response].mean())
    report["recomputed"] = recomputed
    with open(out, "w") as f:
        json.dump(report, f)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
