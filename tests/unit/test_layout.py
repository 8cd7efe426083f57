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
    stage_layer_counts,
    stage_of_layer,
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


# Uneven pipeline stages (Megatron's num_layers_in_first/last_pipeline_stage).


@pytest.mark.parametrize(
    "num_layers, layout, counts",
    [
        (8, ParallelLayout(pp=2), [4, 4]),
        (3, ParallelLayout(pp=2, first_stage_layers=1), [1, 2]),
        (3, ParallelLayout(pp=2, last_stage_layers=1), [2, 1]),
        (61, ParallelLayout(pp=8, first_stage_layers=5), [5, 8, 8, 8, 8, 8, 8, 8]),
        (61, ParallelLayout(pp=4, last_stage_layers=13), [16, 16, 16, 13]),  # slime's DeepSeek-R1 split
        (94, ParallelLayout(pp=4, last_stage_layers=22), [24, 24, 24, 22]),  # slime's Qwen3-235B split
        (61, ParallelLayout(pp=4, first_stage_layers=16, last_stage_layers=15), [16, 15, 15, 15]),
        (10, ParallelLayout(pp=2, first_stage_layers=4, last_stage_layers=6), [4, 6]),
    ],
)
def test_stage_layer_counts(num_layers, layout, counts):
    assert stage_layer_counts(layout, num_layers) == counts
    assert sum(counts) == num_layers
    stages = [
        list(layers_of_stage(num_layers, layout.pp, s, layout.first_stage_layers, layout.last_stage_layers))
        for s in range(layout.pp)
    ]
    assert [len(s) for s in stages] == counts
    assert [i for s in stages for i in s] == list(range(num_layers))  # contiguous, in order, each once
    for stage, layers in enumerate(stages):
        assert all(stage_of_layer(layout, num_layers, i) == stage for i in layers)


@pytest.mark.parametrize(
    "num_layers, layout, message",
    [
        (61, ParallelLayout(pp=8), r"parallel.pp=8: the model's layers \(61\) is not divisible by 8 \(set parallel"
         r".first_stage_layers / last_stage_layers"),
        (61, ParallelLayout(pp=8, first_stage_layers=4), r"parallel.first_stage_layers=4: the remaining 57 of the"
         r" model's 61 layers must split evenly \(at least one each\) over the other 7 of pp=8 stages"),
        (3, ParallelLayout(pp=2, first_stage_layers=1, last_stage_layers=1), r"parallel.first_stage_layers=1,"
         r" parallel.last_stage_layers=1: with pp=2 there are no other stages, so they must add up to the model's 3"),
        (4, ParallelLayout(pp=3, first_stage_layers=2, last_stage_layers=2), r"the remaining 0 of the model's 4"),
        (4, ParallelLayout(pp=2, first_stage_layers=4), r"parallel.first_stage_layers=4: the remaining 0"),
        (4, ParallelLayout(pp=1, last_stage_layers=4), r"parallel.last_stage_layers=4: needs pp >= 2 \(got pp=1\)"),
        (4, ParallelLayout(pp=2, first_stage_layers=0), r"parallel.first_stage_layers=0: must be a positive integer"),
    ],
)  # fmt: skip
def test_uneven_stage_errors_name_the_fields(num_layers, layout, message):
    with pytest.raises(LayoutError, match=message):
        stage_layer_counts(layout, num_layers)


def test_uneven_layout_against_a_model():
    family = get_family("deepseek_v3")
    arch = family.arch_from_hf(family.tiny_hf_config(512))  # 4 layers
    check_layout_fits_model(ParallelLayout(pp=2, first_stage_layers=1), arch)
    check_layout_fits_model(ParallelLayout(pp=3, first_stage_layers=2), arch)  # 2 + 1 + 1
    with pytest.raises(LayoutError, match="parallel.first_stage_layers=3: the remaining 1 of the model's 4 layers"):
        check_layout_fits_model(ParallelLayout(pp=3, first_stage_layers=3), arch)
    with pytest.raises(LayoutError, match="parallel.pp=3: the model's layers \\(4\\) is not divisible by 3"):
        check_layout_fits_model(ParallelLayout(pp=3), arch)


def test_uneven_layout_names_and_megatron_arguments():
    layout = ParallelLayout(pp=8, first_stage_layers=5)
    assert layout.describe() == "tp1-pp8-ep1-etp1-dp1-first5"
    assert layout.megatron_kwargs() == {"num_layers_in_first_pipeline_stage": 5}
    both = ParallelLayout(pp=4, first_stage_layers=16, last_stage_layers=15)
    assert both.describe().endswith("-first16-last15")
    assert both.megatron_kwargs() == {"num_layers_in_first_pipeline_stage": 16, "num_layers_in_last_pipeline_stage": 15}
    assert ParallelLayout(pp=2).megatron_kwargs() == {} and not ParallelLayout(pp=2).uneven


def test_weight_plan_owners_follow_uneven_stages():
    from megatron_rl.weights.plan import owner_rank

    family = get_family("deepseek_v3")
    arch = family.arch_from_hf(family.tiny_hf_config(512))
    layout = ParallelLayout(pp=2, ep=2, first_stage_layers=1)  # stage 0: layer 0, stage 1: layers 1-3
    per_stage = layout.tp * layout.data_parallel
    for rule in family.rule_table(arch).values():
        stage = owner_rank(rule, arch, layout) // per_stage
        if rule.layer is not None:
            assert stage == (0 if rule.layer == 0 else 1), rule.mcore
        elif rule.mcore.startswith("embedding."):
            assert stage == 0
        else:
            assert stage == 1, rule.mcore
