"""Per-token log-probabilities (and the policy's entropy) of given token sequences, computed vocab-parallel.

`forward_logprobs` calls the model with labels, so Megatron's vocab-parallel cross entropy returns -log p(token)
per position. The training forward instead takes each TP rank's slice of the logits `[b, s, V / tp]` and computes
the same cross entropy plus the entropy with all-reduces of the max, `sum exp` and `sum p z` over the TP group
(`logprobs_and_entropy`): no rank ever materialises the full [tokens x vocab] logits when TP > 1.

With the engines' top-k / top-p mask on (`masked_logprobs`), each rank masks its own slice of the logits to the
kept set and the vocab-parallel cross entropy runs on the masked logits as before. The kept set is the engine's
where the batch carries it (`TrainBatch.kept_tokens`: no communication); elsewhere it needs each row's global
ranking, so those logits rows are all-gathered over the TP group (in chunks of rows, without gradient).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import Tensor

from megatron_rl.algorithms.entropy import entropy_from_logits
from megatron_rl.algorithms.sampling_mask import KEEP_ALL, SamplingMask, engine_keep_mask, in_kept_set, keep_mask
from megatron_rl.models.routes import KEPT_PAD
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.micro_batches import (
    loss_layout,
    micro_batch_tokens,
    packed_model_inputs,
    plan_micro_batches,
    schedule_shape,
)
from megatron_rl.trainer.packing import MicroBatching, MicroBatchPlan


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels for every position; the last position gets a dummy label that callers drop."""
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[:, -1] = 0
    return labels


def model_inputs(
    tokens: torch.Tensor, device: torch.device, padding_mask: torch.Tensor | None = None, labels: bool = True
) -> dict:
    """Input ids, position ids and (unless `labels` is False: the model then returns its logits) labels for a
    [batch, seq] token tensor (causal mask built by Megatron), and the MoE routers' padding mask when given (see
    `stage_padding_mask`)."""
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    inputs = {"input_ids": tokens, "position_ids": positions, "attention_mask": None}
    if labels:
        inputs["labels"] = shifted_labels(tokens)
    if padding_mask is not None:
        inputs["padding_mask"] = padding_mask.to(device)
    return inputs


def stage_padding_mask(padding: torch.Tensor, ctx: ParallelContext, sequence_parallel: bool) -> torch.Tensor:
    """The `[B, S]` padding mask (True = padding) as this pipeline stage's GPTModel takes it.

    Megatron's MoE routers leave padding out of the load-balancing losses and the expert-bias token counts
    when given it. The first stage scatters it to sequence-parallel shards itself (with the embeddings); later
    stages get hidden states already sharded along the sequence and pass the mask on as it came (megatron-core
    0.16.1), so they must get this TP rank's sequence slice.
    """
    if ctx.is_first_stage or not sequence_parallel or ctx.layout.tp == 1:
        return padding
    chunk = padding.shape[1] // ctx.layout.tp
    return padding[:, ctx.tp_rank * chunk : (ctx.tp_rank + 1) * chunk]


def _tp_max(x: torch.Tensor) -> torch.Tensor:
    """In-place max over the tensor-parallel group (no gradient: the entropy's shift is detached)."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return x


def vocab_parallel_entropy(logits: torch.Tensor, with_grad: bool = False) -> torch.Tensor:
    """Per-position entropy `[b, s]` of the softmax of vocab-parallel `logits` `[b, s, V / tp]` (this TP rank's
    slice); with `with_grad` its gradient flows back into the logits (the sums' all-reduce passes it unchanged)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        reduce_max = reduce_sum = None
    else:
        reduce_max, reduce_sum = _tp_max, reduce_from_tensor_model_parallel_region
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        return entropy_from_logits(logits.float(), reduce_max, reduce_sum)


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label) `[b, s]` with gradient, entropy `[b, s]`) from vocab-parallel `logits` `[b, s, V / tp]`.

    The logprobs are Megatron's vocab-parallel cross entropy, as with labels: the same numbers. Megatron's cross
    entropy overwrites fp32 logits in place, so the entropy comes first, and when it needs its gradient the cross
    entropy gets a copy.
    """
    entropy = vocab_parallel_entropy(logits, with_grad=entropy_grad)
    source = logits.clone() if entropy_grad else logits
    logprobs = -tensor_parallel.vocab_parallel_cross_entropy(source.float(), labels)
    return logprobs, entropy


def vocab_parallel_logprobs_at(logits: Tensor, ids: Tensor) -> Tensor:
    """log softmax(logits) at `ids` `[b, s, k]` (any token ids, with gradient) from vocab-parallel `logits`
    `[b, s, V / tp]`: the log-sum-exp and each id's logit are summed over the TP group (Megatron's
    `reduce_from_tensor_model_parallel_region`, whose backward leaves each rank its own slice's gradient, as the
    vocab-parallel cross entropy does), so no rank holds the full vocabulary."""
    logits = logits.float()
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    top = logits.detach().amax(dim=-1, keepdim=True)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - top  # the same shift on every rank: the sums below add up
    local = ids.to(logits.device) - start
    inside = (local >= 0) & (local < width)
    picked = torch.gather(shifted, -1, local.clamp(0, width - 1)) * inside
    total = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1, keepdim=True))
    return reduce_from_tensor_model_parallel_region(picked) - total.log()


MASK_CHUNK_ELEMENTS = 1 << 24
"""Full-vocabulary elements (rows x V) gathered at once to find the kept set: each chunk holds a few float32
and int64 copies of that size, 16M elements about 0.4 GiB in all, whatever the micro-batch."""


def _gather_vocab(rows: Tensor, tp: int) -> Tensor:
    """`[n, V / tp]` slices of every TP rank -> `[n, V]` (Megatron's vocab split: rank r holds the r-th block)."""
    if tp == 1:
        return rows
    parts = [torch.empty_like(rows) for _ in range(tp)]
    dist.all_gather(parts, rows.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _aligned_kept(kept: Tensor, seq: int) -> Tensor:
    """The batch's `[b, S-1, K]` kept sets as `[b, S, K]`: the last position (a dummy label) keeps every token."""
    if kept.shape[1] == seq:
        return kept
    last = torch.full_like(kept[:, :1], KEPT_PAD)
    last[..., 0] = KEEP_ALL
    return torch.cat([kept, last], dim=1)


def local_keep_mask(
    logits: Tensor, labels: Tensor, mask: SamplingMask, kept: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(this rank's slice of the kept set `[b, s, V / tp]`, `outside` `[b, s]`) for vocab-parallel `logits`.

    Where the engine's kept set of a position is given (`kept` `[b, s or s-1, K]`, `TrainBatch.kept_tokens`) it
    is used as it is: the set the token was sampled from, whatever the trainer's weights are now. Elsewhere
    (no `kept`, or a row the engine could not identify) the set is recomputed from these logits, on the full
    rows: every TP rank gathers and computes the same mask, chunk by chunk.

    `outside` marks labels the set does not keep; they are added to it all the same, so a trained token's
    logprob stays finite (only a recomputed set can miss one: the trainer's numerics, or a policy that moved
    since sampling, put it just outside).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    width = logits.shape[-1]
    flat = logits.detach().reshape(-1, width)
    flat_labels = labels.reshape(-1, 1)
    if kept is None:
        keep = torch.empty(flat.shape, dtype=torch.bool, device=flat.device)
        known = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
        outside = torch.empty(flat.shape[0], dtype=torch.bool, device=flat.device)
    else:
        given = _aligned_kept(kept.to(flat.device), labels.shape[1])
        given = given.reshape(-1, given.shape[-1])
        keep, known = engine_keep_mask(given, tp_rank * width, width)
        outside = ~in_kept_set(given, flat_labels[:, 0])
    recompute = (~known).nonzero().squeeze(-1)
    step = max(1, MASK_CHUNK_ELEMENTS // (width * tp))
    with torch.no_grad():
        for start in range(0, recompute.numel(), step):
            rows = recompute[start : start + step]
            full = keep_mask(_gather_vocab(flat[rows].float(), tp), mask.top_k, mask.top_p)
            outside[rows] = ~full.gather(-1, flat_labels[rows]).squeeze(-1)
            keep[rows] = full[:, tp_rank * width : (tp_rank + 1) * width]
        local = flat_labels[:, 0] - tp_rank * width
        mine = ((local >= 0) & (local < width)).nonzero().squeeze(-1)
        keep[mine, local[mine]] = True  # the label stays in (its logprob finite) even where the set misses it
    return keep.reshape(logits.shape), outside.reshape(labels.shape)


def masked_logprobs(
    logits: Tensor, labels: Tensor, mask: SamplingMask, kept: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(log p(label) `[b, s]` under the engine's top-k / top-p distribution, with gradient; `outside` `[b, s]`)
    from vocab-parallel (already tempered) `logits` `[b, s, V / tp]`.

    The kept set is the engine's where `kept` gives it, else found on the full rows (`local_keep_mask`); the
    logprob is Megatron's vocab-parallel cross entropy on the logits with -inf outside it, so its gradient is
    that of the masked log-softmax.
    """
    keep, outside = local_keep_mask(logits, labels, mask, kept)
    masked = logits.float().masked_fill(~keep, float("-inf"))
    return -tensor_parallel.vocab_parallel_cross_entropy(masked, labels), outside


def _logprob_step(data_iterator, model):
    item = next(data_iterator)
    output = model(**item["inputs"])  # with labels: the per-token cross entropy, -log p(next token)

    def collect(output_tensor, non_loss_data=False):
        return -item["layout"].back(output_tensor)[:, :-1].detach().float()

    return output, collect


def _logits_of(item: dict, model) -> torch.Tensor:
    """The model's vocab-parallel logits for one forward item (its inputs without labels)."""
    return model(**{k: v for k, v in item["inputs"].items() if k != "labels"})


def _masked_logprob_step(mask: SamplingMask, data_iterator, model):
    item = next(data_iterator)
    output = _logits_of(item, model)

    def collect(output_tensor, non_loss_data=False):
        layout = item["layout"]
        logprobs, _ = masked_logprobs(layout.rows(output_tensor), item["labels"], mask, item["kept"])
        return layout.back(logprobs)[:, :-1].detach().float()

    return output, collect


def _with_untempered_step(mask: SamplingMask | None, temperature: float, data_iterator, model):
    item = next(data_iterator)
    output = _logits_of(item, model)  # already divided by the temperature
    labels = item["labels"]

    def collect(output_tensor, non_loss_data=False):
        layout = item["layout"]
        logits = layout.rows(output_tensor)
        # A new tensor (the cross entropy overwrites its fp32 input): the logits before the temperature's division.
        untempered = -tensor_parallel.vocab_parallel_cross_entropy(logits.float() * temperature, labels)
        if mask is not None and mask.active:
            policy, _ = masked_logprobs(logits, labels, mask, item["kept"])
        else:
            policy = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)
        return torch.stack([layout.back(policy), layout.back(untempered)])[:, :, :-1].detach().float()

    return output, collect


def forward_logprobs(
    model,
    ctx: ParallelContext,
    tokens: torch.Tensor,
    micro_batch_size: int | MicroBatching | MicroBatchPlan = 1,
    mask: SamplingMask | None = None,
    kept: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Log-probs [batch, seq-1] of tokens[:, 1:] given their prefixes; the tensor on last-stage ranks, None elsewhere.

    Every rank must pass the same `tokens`. The sequence length must be divisible by TP (sequence parallel).
    With an active `mask` they are the logprobs under the engines' top-k / top-p distribution (`masked_logprobs`),
    on the engine's kept sets `kept` `[batch, seq-1, K]` where given (`TrainBatch.kept_tokens`).
    `micro_batch_size` is a size or the trainer's `MicroBatching` / a plan (`trainer/packing.py`); packing
    needs the sequences' `lengths`.
    """
    step = partial(_masked_logprob_step, mask) if mask and mask.active else _logprob_step
    return _forward_only(model, ctx, tokens, micro_batch_size, step, kept, lengths)


def forward_logprobs_and_untempered(
    model,
    ctx: ParallelContext,
    tokens: torch.Tensor,
    temperature: float,
    micro_batch_size: int | MicroBatching | MicroBatchPlan = 1,
    mask: SamplingMask | None = None,
    kept: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the policy's logprobs as `forward_logprobs` gives them, the untempered ones), each `[batch, seq-1]`, from
    one forward, on last-stage ranks; None elsewhere.

    The untempered ones are those of the plain softmax of the model's own logits (temperature 1, no top-k /
    top-p): what vLLM's prompt logprobs are, so what a teacher's score is compared with. `temperature` is the one
    the model divides its logits by (`BuildOptions.logit_temperature`).
    """
    step = partial(_with_untempered_step, mask, temperature)
    both = _forward_only(model, ctx, tokens, micro_batch_size, step, kept, lengths, dim=1)
    return None if both is None else (both[0], both[1])


def _forward_item(plan: MicroBatchPlan, index: int, tokens: Tensor, kept: Tensor | None, model, device) -> dict:
    """One forward-only micro-batch: the model's inputs (with labels), the batch-layout labels and kept sets of
    its rows, and the function that takes its outputs back to the batch layout."""
    rows = micro_batch_tokens(plan, tokens, index)
    if plan.packed is None:
        inputs = model_inputs(rows, device)
    else:
        inputs = packed_model_inputs(plan.packed[index], device, model, labels=True)
    layout = loss_layout(plan, index)
    part = None if kept is None else layout.per_position(kept[plan.groups[index]].to(device), KEEP_ALL)
    labels = layout.labels(shifted_labels(rows).to(device))
    return {"inputs": inputs, "labels": labels, "kept": part, "layout": layout}


def _forward_only(
    model,
    ctx: ParallelContext,
    tokens: torch.Tensor,
    micro: int | MicroBatching | MicroBatchPlan,
    step,
    kept: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    dim: int = 0,
) -> Tensor | None:
    """Megatron's forward-only schedule over `tokens` in the micro-batches of `micro` (packed when it says so, by
    `lengths`), without gradient; on last-stage ranks the micro-batches' collected outputs joined along `dim` in
    the batch's row order, None elsewhere. The engine's kept sets `kept` (when given) travel with each
    micro-batch."""
    batch, seq = tokens.shape
    if seq % ctx.layout.tp:
        raise ValueError(f"sequence length {seq} is not divisible by tensor parallel size {ctx.layout.tp}")
    plan = plan_micro_batches(tokens, lengths, micro, ctx)
    items = [_forward_item(plan, i, tokens, kept, model, ctx.device) for i in range(plan.num_micro_batches)]
    seq_length, rows = schedule_shape(plan, model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(items),
                model=[model],
                num_microbatches=len(items),
                seq_length=seq_length,
                micro_batch_size=rows,
                forward_only=True,
                collect_non_loss_data=True,
            )
    finally:
        model.train(was_training)
    return plan.restore(list(outputs), dim=dim) if ctx.is_last_stage else None
