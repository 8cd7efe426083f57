"""Micro-batch plans (`trainer/packing.py`): bins, packed rows and the way back to the batch layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import TrainerConfig
from megatron_rl.trainer.lora import AdaptersOff
from megatron_rl.trainer.micro_batches import as_scheduled, packed_model_inputs, schedule_shape
from megatron_rl.trainer.model import FUSED_SOFTMAX_MODULES, BuildOptions, fusion_settings
from megatron_rl.trainer.packing import (
    MicroBatching,
    first_fit_decreasing,
    pack_rows,
    packed_plan,
    packed_rows_needed,
    padded_group_size,
    padded_plan,
)


def _batch(lengths, seq=12):
    tokens = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, n in enumerate(lengths):
        tokens[row, :n] = 100 * (row + 1) + torch.arange(n)
    return tokens, torch.tensor(lengths)


def test_first_fit_decreasing():
    assert first_fit_decreasing([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert first_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]  # 6+4, 5+3+2
    assert first_fit_decreasing([15, 1], 10) == [[0], [1]]  # longer than the budget: a bin of its own


def test_packed_rows_layout_and_unpacking():
    tokens, lengths = _batch([3, 5, 2])
    packed = pack_rows(tokens, lengths, [[1, 0], [2]], width=10)
    assert packed.shape == (2, 10) and packed.rows.tolist() == [1, 0, 2]
    assert packed.tokens[0, :8].tolist() == [200, 201, 202, 203, 204, 100, 101, 102]
    assert packed.tokens[1, :2].tolist() == [300, 301]
    assert packed.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    # Each token's label is the next of its own sequence; a sequence's last token and the padding get 0.
    assert packed.labels[0].tolist() == [201, 202, 203, 204, 0, 101, 102, 0, 0, 0]
    assert packed.padding()[0].tolist() == [False] * 8 + [True] * 2
    assert packed.padding()[1].tolist() == [False] * 2 + [True] * 8
    back = packed.unpack_rows(packed.tokens[..., None].float())[..., 0].long()
    for i, r in enumerate([1, 0, 2]):
        n = int(lengths[r])
        assert torch.equal(back[i, :n], tokens[r, :n])
    # The thd layout: both rows end to end, each row's padding a segment of its own.
    assert packed.cu_seqlens().tolist() == [0, 5, 8, 10, 12, 20]
    flat = packed.unpack_rows(packed.tokens.reshape(1, -1, 1).float())[..., 0].long()
    assert torch.equal(flat, back)
    with pytest.raises(ValueError, match="do not fit"):
        pack_rows(tokens, lengths, [[0, 1, 2]], width=9)


def test_attention_stays_within_each_sequence():
    tokens, lengths = _batch([2, 3])
    blocked = pack_rows(tokens, lengths, [[0, 1]], width=6).attention_mask()[0, 0]
    allowed = ~blocked
    assert allowed[1].tolist() == [True, True, False, False, False, False]  # sequence 0, causal
    assert allowed[4].tolist() == [False, False, True, True, True, False]  # sequence 1 only
    assert allowed[5].tolist() == [False] * 5 + [True]  # the padding attends to itself: no empty softmax row


def test_plan_restores_row_order_and_packs_routes():
    tokens, lengths = _batch([7, 2, 6, 3, 5])
    plan = packed_plan(lengths, tokens, count=2, width=12)
    assert packed_rows_needed(lengths.tolist(), 12) == 2
    assert plan.num_micro_batches == 2 and plan.seq_length == 12 and plan.rows_per_micro_batch == 1
    assert [p.rows.tolist() for p in plan.packed] == [[0, 4], [1, 2, 3]]  # 7 + 5 and 2 + 6 + 3
    parts = [tokens[g].float() for g in plan.groups]
    assert torch.equal(plan.restore(parts), tokens.float())
    routes = torch.arange(5 * 12).reshape(5, 12, 1, 1)
    free = torch.zeros(5, 12, dtype=torch.bool)
    packed_routes, packed_free = plan.routes(routes, free)
    assert packed_routes.shape == (2, 12, 1, 1) and packed_free.shape == (2, 12)
    first = plan.packed[0]
    n = int(first.lengths[0])
    assert torch.equal(packed_routes[0, :n, 0, 0], routes[int(first.rows[0]), :n, 0, 0])
    assert bool(packed_free[0, int(first.lengths.sum()) :].all()) and not bool(packed_free[0, :n].any())
    # Rows of 8 (7, 6 + 2, 5 + 3) over two micro-batches: two rows each, the last one empty (one shape).
    narrow = packed_plan(lengths, tokens, count=2, width=8)
    assert narrow.rows_per_micro_batch == 2 and all(p.shape == (2, 8) for p in narrow.packed)
    assert bool(narrow.packed[1].padding()[1].all())
    assert plan.token_fill(23) == pytest.approx(23 / 24) and narrow.token_fill(23) == pytest.approx(23 / 32)
    with pytest.raises(ValueError, match="does not fit"):
        packed_plan(lengths, tokens, count=2, width=6)
    # A row count agreed over replicas (the allgather dispatcher's one shape): more rows than the plan needs.
    agreed = packed_plan(lengths, tokens, count=2, width=12, rows=2)
    assert agreed.rows_per_micro_batch == 2 and all(p.shape == (2, 12) for p in agreed.packed)
    assert torch.equal(agreed.restore([tokens[g].float() for g in agreed.groups]), tokens.float())
    with pytest.raises(ValueError, match="3 rows do not fit 1 micro-batches of 2 rows"):
        packed_plan(lengths, tokens, count=1, width=8, rows=2)


def test_padded_micro_batches_by_count_or_tokens():
    assert padded_group_size(8, 32, MicroBatching(size=4)) == 4
    assert padded_group_size(8, 32, MicroBatching(size=1, tokens=100)) == 2  # 3 fit, 2 divides 8
    assert padded_group_size(6, 32, MicroBatching(tokens=10)) == 1
    padded = padded_plan(4, 8, MicroBatching(size=2))
    assert [g.tolist() for g in padded.groups] == [[0, 1], [2, 3]] and padded.token_fill(16) == 0.5
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        padded_group_size(8, 32, MicroBatching(size=3))
    micro = MicroBatching.of(TrainerConfig(micro_batch_size=2, micro_batch_tokens=64, pack_sequences=True))
    assert micro == MicroBatching(size=2, tokens=64, pack=True) and micro.budget(32) == 64
    assert MicroBatching.of(TrainerConfig(pack_sequences=True, moe_dispatcher="allgather")).uniform
    assert MicroBatching(size=2).budget(32) == 64


@pytest.mark.parametrize("attention", ["mask", "thd"])
def test_routes_reach_each_router_token_in_the_order_the_model_reads_them(attention):
    """Routing replay hands each micro-batch's routes to the routers position after position across its rows
    (Megatron's `[s, b]` order): in the `thd` format the packed rows are one row, so the routes must be too."""
    tokens, lengths = _batch([3, 5, 2, 4, 6, 1], seq=8)
    plan = packed_plan(lengths, tokens, count=2, width=8)
    assert plan.rows == 2  # two packed rows a micro-batch: where the two orders differ
    model = SimpleNamespace(packed_attention=attention)
    routes, _ = plan.routes(tokens, torch.zeros_like(tokens, dtype=torch.bool))  # each token's "route": itself
    scheduled = as_scheduled(routes, plan, model)
    per_micro_batch = schedule_shape(plan, model)[1]
    for index, packed in enumerate(plan.packed):
        ids = packed_model_inputs(packed, torch.device("cpu"), model, labels=False)["input_ids"]
        given = scheduled[index * per_micro_batch : (index + 1) * per_micro_batch]
        assert torch.equal(given.transpose(0, 1).reshape(-1), ids.transpose(0, 1).reshape(-1))


def test_packed_sequences_turn_the_fused_masked_softmax_off():
    """Megatron's fused causal softmax (GPU, half precision, local spec) ignores the mask it is given, so packed
    sequences would attend across their neighbours: packing builds the model without it, and a model built with
    it refuses packed micro-batches."""
    assert fusion_settings(True, BuildOptions(), softmax_kernels=True)["masked_softmax_fusion"]
    assert not fusion_settings(True, BuildOptions(packed_sequences=True), softmax_kernels=True)["masked_softmax_fusion"]
    assert not fusion_settings(False, BuildOptions())["masked_softmax_fusion"]
    # Without Apex's extensions the fused softmax's first bf16 forward would fail on import: off.
    assert not fusion_settings(True, BuildOptions(), softmax_kernels=False)["masked_softmax_fusion"]
    tokens, lengths = _batch([3, 5, 2], seq=8)
    packed = packed_plan(lengths, tokens, count=1, width=8).packed[0]
    inner = torch.nn.Module()  # stands for the GPTModel: the wrapper below is the real LoRA view
    inner.packed_attention = "mask"
    inner.config = SimpleNamespace(**fusion_settings(True, BuildOptions(), True))
    fused = AdaptersOff(inner)
    with pytest.raises(ValueError, match="packed_sequences=True"):
        packed_model_inputs(packed, torch.device("cpu"), fused, labels=False)
    inner.config.masked_softmax_fusion = False
    assert packed_model_inputs(packed, torch.device("cpu"), fused, labels=False)["attention_mask"].shape == (2, 1, 8, 8)


def test_the_fused_softmax_is_used_only_where_its_kernels_are_installed(monkeypatch):
    """Megatron imports Apex's softmax extensions at the first forward a shape qualifies for: a GPU without them
    builds the model unfused rather than failing there."""
    import importlib.util

    installed: set[str] = set()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert not fusion_settings(True, BuildOptions())["masked_softmax_fusion"]
    installed.update(FUSED_SOFTMAX_MODULES[:1])
    assert not fusion_settings(True, BuildOptions())["masked_softmax_fusion"]  # both are needed
    installed.update(FUSED_SOFTMAX_MODULES)
    assert fusion_settings(True, BuildOptions())["masked_softmax_fusion"]
    assert not fusion_settings(False, BuildOptions())["masked_softmax_fusion"]
