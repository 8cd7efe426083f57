"""Rank layout arithmetic: golden values and validation messages."""

from __future__ import annotations

import pytest

from megatron_rl.models import get_family
from megatron_rl.parallel.layout import (
    LayoutError,
    ParallelLayout,
    check_layout,
    check_layout_fits_model,
    experts_of_rank,
    layers_of_stage,
    rank_coords,
)


@pytest.mark.parametrize(
    "layout, world",
    [
        (ParallelLayout(), 1),
        (ParallelLayout(tp=2), 2),
        (ParallelLayout(ep=2), 2),
        (ParallelLayout(tp=2, ep=2), 2),
        (ParallelLayout(pp=2, ep=2), 4),
        (ParallelLayout(tp=2, pp=2, ep=2), 4),
        (ParallelLayout(tp=2, pp=2, ep=2, dp=2), 8),
        (ParallelLayout(tp=2, ep=4, etp=2), 8),
        (ParallelLayout(tp=8, pp=4, ep=64, etp=1), 256),
    ],
)
def test_world_size(layout, world):
    assert layout.world_size == world
    check_layout(layout, world)


def test_world_size_mismatch_is_named():
    with pytest.raises(LayoutError, match=r"world size 3 is not tp\*pp\*dp"):
        check_layout(ParallelLayout(tp=2), 3)


def test_expert_fold_must_divide():
    with pytest.raises(LayoutError, match="not divisible by ep\\*etp"):
        check_layout(ParallelLayout(tp=2, dp=1, ep=4))


@pytest.mark.parametrize(
    "layout, message",
    [
        (ParallelLayout(ep=3, dp=3), "experts \\(8\\) is not divisible by 3"),
        (ParallelLayout(pp=3), "layers \\(2\\) is not divisible by 3"),
        (ParallelLayout(tp=4), "key/value heads \\(2\\) is not divisible by 4"),
        (ParallelLayout(tp=0), "parallel.tp=0: must be a positive integer"),
    ],
)
def test_layout_against_model(layout, message):
    family = get_family("qwen3_moe")
    arch = family.arch_from_hf(family.tiny_hf_config(512))
    with pytest.raises(LayoutError, match=message):
        check_layout_fits_model(layout, arch)


def test_dense_model_refuses_ep():
    family = get_family("qwen3")
    with pytest.raises(LayoutError, match="has no experts"):
        check_layout_fits_model(ParallelLayout(ep=2), family.arch_from_hf(family.tiny_hf_config(512)))


def test_rank_coords_golden():
    # Megatron's default order: tp fastest, then dp, then pp; experts re-divide each stage as etp-ep-edp.
    layout = ParallelLayout(tp=2, pp=2, ep=2)
    coords = [rank_coords(layout, r) for r in range(4)]
    assert [(c.tp, c.pp, c.dp, c.ep) for c in coords] == [(0, 0, 0, 0), (1, 0, 0, 1), (0, 1, 0, 0), (1, 1, 0, 1)]
    layout = ParallelLayout(tp=1, ep=2, dp=4)
    assert [rank_coords(layout, r).ep for r in range(4)] == [0, 1, 0, 1]
    assert [rank_coords(layout, r).edp for r in range(4)] == [0, 0, 1, 1]


def test_stage_and_expert_ranges():
    assert list(layers_of_stage(8, 2, 1)) == [4, 5, 6, 7]
    assert list(experts_of_rank(8, 4, 3)) == [6, 7]
