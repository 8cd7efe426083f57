"""What a data-parallel share sends to the stats owner (`trainer/train_step.py`): only the fields the stats read,
as numpy arrays where numpy has the dtype, and the same stats as the whole batch's."""

from __future__ import annotations

import pickle

import torch

from megatron_rl.config import AlgorithmConfig
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.train_step import (
    STATS_FIELDS,
    _from_numpy,
    _to_numpy,
    batch_stats,
    concat_batches,
    loss_spec,
    stats_view,
)


def _batch(rows: int = 8, seq: int = 12, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, seq - 1, dtype=torch.bool)
    mask[:, seq // 2 :] = True
    return TrainBatch(
        tokens=torch.randint(0, 50, (rows, seq), generator=g),
        loss_mask=mask,
        advantages=torch.randn(rows, generator=g),
        behaviour_logprobs=-torch.rand(rows, seq - 1, generator=g),
        proximal_logprobs=-torch.rand(rows, seq - 1, generator=g),
        versions=torch.randint(3, 5, (rows, seq - 1), generator=g),
        routes=torch.randint(0, 8, (rows, seq, 4, 2), generator=g, dtype=torch.int16),
        kept_tokens=torch.randint(0, 50, (rows, seq - 1, 20), generator=g, dtype=torch.int32),
        teacher_logprobs=-torch.rand(rows, seq - 1, generator=g).to(torch.bfloat16),
    )


def test_a_share_keeps_only_the_fields_the_stats_read():
    view = stats_view(_batch())
    assert view.routes is None and view.kept_tokens is None and view.teacher_logprobs is None
    assert all(getattr(view, f) is not None for f in STATS_FIELDS if f != "ref_logprobs")
    assert view.batch_size == 8


def test_numpy_round_trip_is_exact_and_cheaper_to_pickle():
    batch = _batch()
    share = (batch, -torch.rand(8, 11), None, torch.rand(3).to(torch.bfloat16))
    wire = _to_numpy(share)
    back = _from_numpy(pickle.loads(pickle.dumps(wire)))
    assert back[2] is None and back[3].dtype == torch.bfloat16 and torch.equal(back[3], share[3])
    assert torch.equal(back[1], share[1])
    for name in ("tokens", "loss_mask", "versions", "routes", "kept_tokens", "teacher_logprobs", "ref_logprobs"):
        before, after = getattr(batch, name), getattr(back[0], name)
        assert (before is None and after is None) or (after.dtype == before.dtype and torch.equal(after, before))
    # Raw bytes: within 10% of the tensors' own size (a tensor's pickle carries torch.save's archive per tensor).
    raw = sum(t.numel() * t.element_size() for t in (batch.tokens, batch.loss_mask, batch.behaviour_logprobs))
    small = TrainBatch(batch.tokens, batch.loss_mask, batch.advantages[:0], batch.behaviour_logprobs)
    assert len(pickle.dumps(_to_numpy(small))) < 1.1 * raw + 2000


def test_the_stats_of_gathered_views_are_the_whole_batchs():
    spec = loss_spec(AlgorithmConfig(loss="decoupled_ppo", correction="tis", is_cap=2.0), max_new_tokens=6)
    batch = _batch(rows=8)
    current = -torch.rand(8, 11, generator=torch.Generator().manual_seed(1))
    halves = [batch.select(slice(0, 4)), batch.select(slice(4, 8))]
    shares = [_from_numpy(pickle.loads(pickle.dumps(_to_numpy((stats_view(h),))))) for h in halves]
    full = concat_batches([s[0] for s in shares])
    assert batch_stats(current, full, spec, fresh_version=4) == batch_stats(current, batch, spec, fresh_version=4)
