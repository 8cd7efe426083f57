"""Per-token log-probabilities of given token sequences, computed vocab-parallel through the pipeline schedule.

The model is called with labels, so Megatron's vocab-parallel cross entropy returns -log p(token) per position:
no rank ever materialises the full [tokens x vocab] logits when TP > 1.
"""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.parallel.groups import ParallelContext


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels for every position; the last position gets a dummy label that callers drop."""
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[:, -1] = 0
    return labels


def model_inputs(tokens: torch.Tensor, device: torch.device, padding_mask: torch.Tensor | None = None) -> dict:
    """Input ids, position ids and labels for a [batch, seq] token tensor (causal mask built by Megatron), and
    the MoE routers' padding mask when given (see `stage_padding_mask`)."""
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    inputs = {"input_ids": tokens, "position_ids": positions, "attention_mask": None, "labels": shifted_labels(tokens)}
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


def _logprob_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(**batch)

    def collect(output_tensor, non_loss_data=False):
        # output_tensor is the per-token cross entropy [batch, seq]: -log p(next token).
        return -output_tensor[:, :-1].detach().float()

    return output, collect


def forward_logprobs(
    model, ctx: ParallelContext, tokens: torch.Tensor, micro_batch_size: int = 1
) -> torch.Tensor | None:
    """Log-probs [batch, seq-1] of tokens[:, 1:] given their prefixes; the tensor on last-stage ranks, None elsewhere.

    Every rank must pass the same `tokens`. The sequence length must be divisible by TP (sequence parallel).
    """

    batch, seq = tokens.shape
    if seq % ctx.layout.tp:
        raise ValueError(f"sequence length {seq} is not divisible by tensor parallel size {ctx.layout.tp}")
    if batch % micro_batch_size:
        raise ValueError(f"batch {batch} is not divisible by micro_batch_size {micro_batch_size}")
    micro_batches = [model_inputs(mb, ctx.device) for mb in tokens.split(micro_batch_size)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=_logprob_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=seq,
                micro_batch_size=micro_batch_size,
                forward_only=True,
                collect_non_loss_data=True,
            )
    finally:
        model.train(was_training)
    if not ctx.is_last_stage:
        return None
    return torch.cat(list(outputs), dim=0)
