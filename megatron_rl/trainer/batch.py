"""The batch one RL optimizer step trains on: token sequences, the response mask and per-token old logprobs.

Alignment: `tokens` is `[B, S]` (prompt + response, right-padded); every per-token tensor is `[B, S-1]` and its
position `t` belongs to the prediction of `tokens[:, t + 1]` (the logprob Megatron computes at position `t`).
So the response token at index `j` of `tokens` is position `j - 1` of `loss_mask`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.sampling_mask import KEEP_ALL
from megatron_rl.models.routes import KEPT_PAD, TOP_PAD_LOGPROB, decode_kept_sets, decode_routes, decode_teacher_top

if TYPE_CHECKING:  # the rollout's sample contract; the trainer only reads its fields
    from megatron_rl.rollout.types import Group

_PER_TOKEN = ("loss_mask", "behaviour_logprobs", "proximal_logprobs", "ref_logprobs", "teacher_logprobs", "versions")
_PER_SEQUENCE = ("lengths", "rewards", "group_ids")


@dataclasses.dataclass
class TrainBatch:
    """One step's sequences, with the per-token inputs of the policy loss."""

    tokens: Tensor
    """`[B, S]` int64 token ids (prompt + response, right-padded; pad value irrelevant under the mask)."""
    loss_mask: Tensor
    """`[B, S-1]` 1 (or True) where position t predicts a response token `tokens[:, t+1]`, 0 elsewhere."""
    advantages: Tensor
    """`[B]` one advantage per sequence, or `[B, S-1]` per token."""
    behaviour_logprobs: Tensor
    """`[B, S-1]` logprobs of the sampled tokens under the inference engine's policy (0 outside the mask)."""
    proximal_logprobs: Tensor | None = None
    """`[B, S-1]` logprobs under the weights the step starts from (decoupled PPO); see `train_step`."""
    ref_logprobs: Tensor | None = None
    """`[B, S-1]` logprobs under the reference policy (KL penalty only)."""
    teacher_logprobs: Tensor | None = None
    """`[B, S-1]` the teacher's untempered logprobs of the response tokens (on-policy distillation only)."""
    lengths: Tensor | None = None
    """`[B]` int64 real tokens (prompt + response) of each sequence; the rest of its row is padding. Without it
    a row ends at its last response token."""
    rewards: Tensor | None = None
    """`[B]` float64 reward of each sequence (what the advantages were computed from; KL-in-reward recomputes
    them)."""
    group_ids: Tensor | None = None
    """`[B]` int64 index of each sequence's group in the global batch (0..G-1)."""
    routes: Tensor | None = None
    """`[B, S, moe_layers, top_k]` the experts the engine chose for each position (routing replay / agreement)."""
    route_free: Tensor | None = None
    """`[B, S]` bool, True where `routes` holds nothing (each sequence's last token and the padding)."""
    versions: Tensor | None = None
    """`[B, S-1]` int64 the weight version that sampled each response token (-1 elsewhere): which tokens are
    fresh (sampled by the weights the step starts from) for `mismatch/fresh_*`."""
    teacher_top_ids: Tensor | None = None
    """`[B, S-1, k]` int64 the teacher's k best token ids at each response position (`distill.loss: topk_*`;
    0 elsewhere)."""
    teacher_top_logprobs: Tensor | None = None
    """`[B, S-1, k]` float32 the teacher's untempered logprobs of `teacher_top_ids` (`TOP_PAD_LOGPROB` elsewhere)."""
    kept_tokens: Tensor | None = None
    """`[B, S-1, K]` int32: at a response position, the token ids the engine's top-k / top-p sampler kept
    there (padded with -1; only -1: the engine could not identify it, the trainer recomputes it); elsewhere a row
    starting with `algorithms.sampling_mask.KEEP_ALL`. None: every kept set is recomputed from the trainer's logits."""

    @property
    def batch_size(self) -> int:
        """Number of sequences."""
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Padded sequence length S of `tokens`."""
        return int(self.tokens.shape[1])

    def validate(self, tp: int = 1) -> None:
        """Raise ValueError naming the field whose shape does not fit, or when S is not a multiple of `tp`."""
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens: expected [batch, seq], got shape {tuple(self.tokens.shape)}")
        b, s = self.tokens.shape
        if s < 2:
            raise ValueError(f"tokens: sequence length {s} leaves nothing to predict")
        if s % tp:
            raise ValueError(
                f"tokens: sequence length {s} is not a multiple of tensor parallel size {tp} (`groups_to_batch` pads "
                "to a multiple of it)"
            )
        for name in _PER_TOKEN:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, s - 1):
                raise ValueError(f"{name}: expected shape {(b, s - 1)}, got {tuple(value.shape)}")
        for name in _PER_SEQUENCE:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b,):
                raise ValueError(f"{name}: expected shape {(b,)}, got {tuple(value.shape)}")
        if self.lengths is not None:
            lengths = self.lengths
            if bool((lengths < 1).any()) or bool((lengths > s).any()):
                raise ValueError(f"lengths: expected shape {(b,)} with values in [1, {s}], got {lengths.tolist()}")
            # No response token beyond a sequence's end (the mask's position t predicts token t + 1).
            beyond = self.loss_mask.bool() & (torch.arange(1, s, device=lengths.device) >= lengths[:, None])
            if bool(beyond.any()):
                row = int(beyond.any(dim=1).nonzero()[0])
                raise ValueError(f"lengths: row {row} has loss_mask beyond its length {int(lengths[row])}")
        if self.routes is not None and (
            self.routes.dim() != 4 or tuple(self.routes.shape[:2]) != (b, s) or self.route_free is None
            or tuple(self.route_free.shape) != (b, s)
        ):  # fmt: skip
            raise ValueError(f"routes: expected [{b}, {s}, layers, top_k] with route_free [{b}, {s}]")
        if self.kept_tokens is not None and (
            self.kept_tokens.dim() != 3 or tuple(self.kept_tokens.shape[:2]) != (b, s - 1)
        ):
            raise ValueError(f"kept_tokens: expected [{b}, {s - 1}, K], got {tuple(self.kept_tokens.shape)}")
        if tuple(self.advantages.shape) not in ((b,), (b, s - 1)):
            raise ValueError(f"advantages: expected shape {(b,)} or {(b, s - 1)}, got {tuple(self.advantages.shape)}")

    def padding_mask(self) -> Tensor:
        """`[B, S]` bool, True at the right padding: from `lengths` when given, else every position after a
        sequence's last response token (a sequence without response tokens then gets no padding marks)."""
        columns = torch.arange(self.seq_len, device=self.tokens.device).expand(self.batch_size, -1)
        if self.lengths is not None:
            return columns >= self.lengths.to(columns.device)[:, None]
        mask = self.loss_mask.bool()
        # loss_mask[:, t] marks the prediction of tokens[:, t + 1]: the last response token sits at t + 1.
        last = torch.where(mask, columns[:, 1:], torch.zeros_like(columns[:, 1:])).amax(dim=1, keepdim=True)
        return (columns > last) & mask.any(dim=1, keepdim=True)

    def select(self, rows: slice | Tensor) -> TrainBatch:
        """The sequences at `rows` (a slice or index tensor), every field cut alike."""
        return TrainBatch(**{f.name: _take(getattr(self, f.name), rows) for f in dataclasses.fields(self)})

    def split(self, micro_batch_size: int) -> list[TrainBatch]:
        """Consecutive micro-batches of `micro_batch_size` sequences (the batch size must be a multiple)."""
        if micro_batch_size < 1 or self.batch_size % micro_batch_size:
            raise ValueError(f"batch of {self.batch_size} is not divisible by micro_batch_size {micro_batch_size}")
        return [self.select(slice(i, i + micro_batch_size)) for i in range(0, self.batch_size, micro_batch_size)]

    def minibatches(self, count: int) -> list[TrainBatch]:
        """`count` consecutive mini-batches of equal size (the batch size must be a multiple of `count`)."""
        if count < 1 or self.batch_size % count:
            raise ValueError(
                f"a share of {self.batch_size} sequences cannot be split into algorithm.ppo_minibatches={count} equal"
                " mini-batches"
            )
        per = self.batch_size // count
        return [self.select(slice(i * per, (i + 1) * per)) for i in range(count)]

    def replace(self, **changes) -> TrainBatch:
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor moved to `device`."""
        return TrainBatch(**{f.name: _move(getattr(self, f.name), device) for f in dataclasses.fields(self)})


def _take(value: Tensor | None, rows: slice | Tensor) -> Tensor | None:
    return None if value is None else value[rows]


def _move(value: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if value is None else value.to(device)


def data_parallel_shard(batch: TrainBatch, dp_rank: int, dp_size: int) -> TrainBatch:
    """The contiguous share of a global batch that data-parallel rank `dp_rank` trains on.

    Every rank of one data-parallel replica (its TP, PP, EP peers) must train on the same share.
    """
    if batch.batch_size % dp_size:
        raise ValueError(f"global batch of {batch.batch_size} is not divisible by data parallel size {dp_size}")
    per = batch.batch_size // dp_size
    return batch.select(slice(dp_rank * per, (dp_rank + 1) * per))


def replica_rows(batch_size: int, dp_rank: int, dp_size: int, minibatches: int = 1) -> Tensor:
    """Global row indices of data-parallel rank `dp_rank`'s share when the batch trains in `minibatches`
    consecutive mini-batches: its slice of each mini-batch in turn, so that the share's own consecutive
    mini-batches are its parts of the global ones (the same rows at every layout). With one mini-batch it is
    the contiguous slice `data_parallel_shard` takes."""
    if batch_size % (dp_size * minibatches):
        raise ValueError(
            f"global batch of {batch_size} is not divisible by data parallel size {dp_size} x"
            f" algorithm.ppo_minibatches={minibatches}"
        )
    per_mb, per_rank = batch_size // minibatches, batch_size // minibatches // dp_size
    starts = [k * per_mb + dp_rank * per_rank for k in range(minibatches)]
    return torch.cat([torch.arange(start, start + per_rank) for start in starts])


def replica_share(batch: TrainBatch, dp_rank: int, dp_size: int, minibatches: int = 1) -> TrainBatch:
    """Data-parallel rank `dp_rank`'s share of a global batch trained in `minibatches` (`replica_rows`)."""
    return batch.select(replica_rows(batch.batch_size, dp_rank, dp_size, minibatches))


def pad_length(longest: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that holds `longest` tokens."""
    return max(multiple, math.ceil(longest / multiple) * multiple)


def ragged_positions(lengths: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, columns) of `lengths[i]` consecutive positions from `starts[i]` in each row i, row by row: the
    places of a ragged batch's values, flattened in that order, in a padded `[rows, columns]` tensor."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths  # where each row's values begin in the flat order
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets - starts, lengths)
    return rows, cols


def groups_to_batch(groups: Sequence[Group], advantage: str, tp: int, pad_id: int = 0) -> TrainBatch:
    """One sequence per sample: tokens = prompt + response (right-padded to a multiple of `tp`), the mask on the
    positions that predict response tokens, the engine's logprobs there, and group-relative advantages."""
    samples = [s for g in groups for s in g.samples]
    seq = pad_length(max(len(s.prompt_ids) + len(s.response_ids) for s in samples), max(tp, 2))
    tokens = torch.full((len(samples), seq), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), seq - 1)
    behaviour = torch.zeros(len(samples), seq - 1)
    versions = torch.full((len(samples), seq - 1), -1, dtype=torch.long)
    scored = [s.teacher_logprobs is not None for s in samples]
    if any(scored) and not all(scored):
        raise ValueError(f"{scored.count(False)} of {len(samples)} samples have no teacher logprobs (all or none must)")
    teacher = torch.zeros(len(samples), seq - 1) if all(scored) else None
    routes, route_free = batch_routes(samples, seq)
    kept = batch_kept_sets(samples, seq)
    top_ids, top_logprobs = batch_teacher_top(samples, seq)
    # One scatter per tensor, not a few small ones per sample (`Sample` checks one logprob and version per token).
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    response_lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    rows, cols = ragged_positions(prompt_lens + response_lens, torch.zeros_like(prompt_lens))
    tokens[rows, cols] = torch.tensor([t for s in samples for ids in (s.prompt_ids, s.response_ids) for t in ids])
    rows, cols = ragged_positions(response_lens, prompt_lens - 1)  # position t predicts token t + 1
    mask[rows, cols] = 1.0
    behaviour[rows, cols] = torch.tensor([x for s in samples for x in s.logprobs], dtype=torch.float32)
    versions[rows, cols] = torch.tensor([v for s in samples for v in s.versions], dtype=torch.long)
    if teacher is not None:
        teacher[rows, cols] = torch.tensor([x for s in samples for x in s.teacher_logprobs], dtype=torch.float32)
    # float64: float32 would turn a reward of 1e39 into inf, and lose the spread of rewards near 1e20.
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples], dtype=torch.long)
    advantages = compute_advantages(advantage, rewards, group_ids=group_ids).float()
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=torch.long)
    return TrainBatch(
        tokens=tokens, loss_mask=mask, advantages=advantages, behaviour_logprobs=behaviour, lengths=lengths,
        rewards=rewards, group_ids=group_ids, teacher_logprobs=teacher, routes=routes, route_free=route_free,
        kept_tokens=kept, versions=versions, teacher_top_ids=top_ids, teacher_top_logprobs=top_logprobs,
    )  # fmt: skip


def _all_or_none(samples: Sequence, key: str, what: str) -> bool:
    """Whether the samples carry `metadata[key]`: all do (True) or none (False); ValueError naming `what` else."""
    carried = [key in s.metadata for s in samples]
    if any(carried) and not all(carried):
        raise ValueError(f"{carried.count(False)} of {len(samples)} samples carry no {what} (all or none must)")
    return bool(carried) and all(carried)


def batch_teacher_top(samples: Sequence, seq: int) -> tuple[Tensor | None, Tensor | None]:
    """(`[B, S-1, k]` ids, logprobs) of the teacher's top k at each response position, from the samples'
    `metadata["teacher_top"]` (all or none carry them); (None, None) when none do."""
    if not _all_or_none(samples, "teacher_top", "teacher top-k"):
        return None, None
    rows = [decode_teacher_top(s.metadata["teacher_top"]) for s in samples]
    widths = {ids.shape[1] for ids, _ in rows}
    if len(widths) != 1:
        raise ValueError(f"samples' teacher top-k have different widths: {sorted(widths)}")
    k = widths.pop()
    ids = torch.zeros(len(samples), seq - 1, k, dtype=torch.long)
    logprobs = torch.full((len(samples), seq - 1, k), TOP_PAD_LOGPROB, dtype=torch.float32)
    for row, (sample, (i, lp)) in enumerate(zip(samples, rows)):
        n, start = len(sample.response_ids), len(sample.prompt_ids) - 1  # position t predicts token t + 1
        if i.shape[0] != n:
            raise ValueError(f"sample of prompt {sample.prompt_index}: teacher top-k of {i.shape[0]} tokens, not {n}")
        ids[row, start : start + n] = torch.from_numpy(i.astype("int64"))
        logprobs[row, start : start + n] = torch.from_numpy(lp.copy())
    return ids, logprobs


def batch_routes(samples: Sequence, seq: int) -> tuple[Tensor | None, Tensor | None]:
    """(`[B, S, L, k]` routes, `[B, S]` free mask) from the samples' `metadata["routes"]` (all or none carry them),
    row r position t the experts that computed token t of prompt + response; (None, None) when none carry them."""
    if not _all_or_none(samples, "routes", "routes"):
        return None, None
    rows = [decode_routes(s.metadata["routes"]) for s in samples]
    shapes = {r.shape[1:] for r in rows}
    if len(shapes) != 1:
        raise ValueError(f"samples' routes have different [layers, top_k]: {sorted(shapes)}")
    routes = torch.zeros(len(samples), seq, *shapes.pop(), dtype=torch.long)
    free = torch.ones(len(samples), seq, dtype=torch.bool)
    for row, (sample, r) in enumerate(zip(samples, rows)):
        n = len(sample.prompt_ids) + len(sample.response_ids) - 1  # the last token was never fed to the engine
        if r.shape[0] != n:
            raise ValueError(f"sample of prompt {sample.prompt_index}: routes for {r.shape[0]} positions, expected {n}")
        routes[row, :n] = torch.from_numpy(r.astype("int64"))
        free[row, :n] = False
    return routes, free


def batch_kept_sets(samples: Sequence, seq: int) -> Tensor | None:
    """`[B, S-1, K]` int32 kept sets (`TrainBatch.kept_tokens`) from the samples' `metadata["kept_sets"]`
    (`[response tokens, K_i]`, K the widest); None when no sample carries them. A sample without them (a buffer
    checkpoint from before they were sent) gets unknown rows: the trainer recomputes its sets."""
    carried = [decode_kept_sets(s.metadata["kept_sets"]) if "kept_sets" in s.metadata else None for s in samples]
    if all(rows is None for rows in carried):
        return None
    width = max(rows.shape[1] for rows in carried if rows is not None)
    kept = torch.full((len(samples), seq - 1, width), KEPT_PAD, dtype=torch.int32)
    kept[..., 0] = KEEP_ALL  # positions nothing is trained on
    for row, (sample, rows) in enumerate(zip(samples, carried)):
        start, n = len(sample.prompt_ids) - 1, len(sample.response_ids)  # position t predicts token t + 1
        if rows is not None and rows.shape[0] != n:
            raise ValueError(
                f"sample of prompt {sample.prompt_index}: kept sets for {rows.shape[0]} tokens, expected {n}"
            )
        kept[row, start : start + n] = KEPT_PAD
        if rows is not None:
            kept[row, start : start + n, : rows.shape[1]] = torch.from_numpy(rows.copy())
    return kept
