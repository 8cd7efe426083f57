"""The owner-aware plan: expert tensors only to the engine workers that host them (expert-parallel engines)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.models import get_family
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.weights.engine.receiver import WeightReceiver
from megatron_rl.weights.owners import PlacementError, expert_receivers, hosted_summary
from megatron_rl.weights.plan import (
    HEADER_BYTES,
    ROW_BLOCKS_T16,
    plan_buckets,
    plan_from_json,
    plan_summary,
    plan_to_json,
    received_bytes,
    tensor_specs,
)
from megatron_rl.weights.sender import BucketFiller
from megatron_rl.weights.sync import agreed_wire_layouts, agreed_wire_places


def _specs(layout: ParallelLayout):
    """Every HF tensor of the tiny Qwen3-MoE (2 layers, 8 experts) with its owner at `layout`, fp32."""
    fam = get_family("qwen3_moe")
    arch = fam.arch_from_hf(fam.tiny_hf_config(512))
    rules = fam.rule_table(arch)
    names = [n for r in rules.values() for n in r.hf]
    return arch, tensor_specs(rules, {n: (32, 16) for n in names}, {n: "float32" for n in names}, arch, layout)


def _linear(ep_rank: int, ep_size: int, layers: int = 2, experts: int = 8) -> dict:
    """A worker's placement as vLLM's linear strategy makes it."""
    per = experts // ep_size
    hosted = list(range(ep_rank * per, (ep_rank + 1) * per))
    return {"layers": {str(i): hosted for i in range(layers)}, "experts": experts, "ep_rank": ep_rank,
            "ep_size": ep_size, "strategy": "linear"}  # fmt: skip


# engine-0: TP2 with expert parallelism (group ranks 1 and 2); engine-1: TP1 without (rank 3, every expert).
ENGINES = [("engine-0", [1, 2]), ("engine-1", [3])]
PLACEMENTS = {1: _linear(0, 2), 2: _linear(1, 2), 3: None}


def test_each_expert_goes_to_its_hosts_and_every_worker_of_an_engine_without_expert_parallelism():
    _, specs = _specs(ParallelLayout(tp=2, ep=2))
    receivers = expert_receivers(specs, PLACEMENTS, ENGINES)
    for spec in specs:
        if not spec.is_expert:
            assert spec.name not in receivers  # broadcast to everyone, as without expert parallelism
        else:
            assert receivers[spec.name] == ((1, 3) if spec.expert < 4 else (2, 3)), spec
    # Engines that all host every expert: nothing changes, every tensor is broadcast as before.
    assert expert_receivers(specs, {1: None, 2: None, 3: None}, ENGINES) == {}
    assert hosted_summary(PLACEMENTS) == {1: "4/8 (linear): [0, 1, 2, 3]", 2: "4/8 (linear): [4, 5, 6, 7]", 3: "all"}


def test_the_plan_sends_expert_buckets_to_their_hosts_alone_and_each_worker_receives_its_share():
    _, specs = _specs(ParallelLayout(tp=2, ep=2))
    receivers = expert_receivers(specs, PLACEMENTS, ENGINES)
    plan = plan_buckets(specs, 4096, layouts={s.name: ROW_BLOCKS_T16 for s in specs if s.is_expert},
                        receivers=receivers)  # fmt: skip
    for bucket in plan:
        assert {receivers.get(s.name, ()) for s in bucket.slots} == {bucket.receivers}  # never mixed
        assert bool(bucket.receivers) == bucket.is_expert
    expert = sum(s.nbytes for s in specs if s.is_expert)
    dense = sum(s.nbytes for s in specs) - expert
    per_worker = {m: received_bytes(plan, m) for m in (1, 2, 3)}
    headers = HEADER_BYTES * len(plan)
    assert dense + expert / 2 <= per_worker[1] == per_worker[2] <= dense + expert / 2 + headers
    assert per_worker[3] == plan_summary(plan)["bytes"]  # the engine without expert parallelism gets everything
    broadcast = plan_buckets(specs, 4096)
    assert all(received_bytes(broadcast, m) == plan_summary(broadcast)["bytes"] for m in (1, 2, 3))
    # Tags: one per point-to-point transfer of the update, consecutive within a bucket, and they survive JSON.
    tags = [b.tag(i) for b in plan if b.receivers for i in range(len(b.broadcasts))]
    assert tags == list(range(len(tags)))
    assert plan_from_json(plan_to_json(plan)) == plan


def test_buckets_of_several_receiver_sets_fill_side_by_side_and_go_out_in_plan_order():
    """One trainer rank yields every expert (layer by layer) into an engine whose two workers host half each."""
    _, specs = _specs(ParallelLayout())
    receivers = expert_receivers(specs, {1: _linear(0, 2), 2: _linear(1, 2)}, [("engine-0", [1, 2])])
    plan = plan_buckets(specs, 3 * 32 * 16 * 4 + 3 * HEADER_BYTES, receivers=receivers)  # three tensors a bucket
    experts = [b for b in plan if b.is_expert]
    # Worker 1's last bucket of layer 0 stays open while worker 2's fill, and closes when layer 1 begins...
    assert [b.receivers for b in experts[:7]] == [(1,)] * 3 + [(2,)] * 3 + [(1,)]
    filler = BucketFiller(plan, rank=0)
    sent, most_held = [], 0
    yielded = [s for s in specs if not s.is_expert] + [s for s in specs if s.is_expert]  # as the gather's passes
    for spec in yielded:  # ...and the tensors come interleaved, in the order the gather yields them
        sent += [bucket.index for bucket, _ in filler.add(spec.name, torch.zeros(1))]
        most_held = max(most_held, filler.held())
    filler.check_complete()
    assert sent == [b.index for b in plan]
    assert most_held <= 2 * 3  # at most one open bucket per receiver set is held back
    with pytest.raises(RuntimeError, match="not in this rank's plan"):
        BucketFiller(plan, rank=0).add("model.norm.weight-typo", torch.zeros(1))
    incomplete = BucketFiller(plan, rank=0)
    incomplete.add(specs[0].name, torch.zeros(1))
    with pytest.raises(RuntimeError, match=f"bucket {plan[0].index} was never filled"):
        incomplete.check_complete()


def test_placements_that_cannot_be_planned_from_are_named():
    _, specs = _specs(ParallelLayout(ep=2))
    only_layer0 = {**_linear(0, 2), "layers": {"0": [0, 1, 2, 3]}}
    with pytest.raises(PlacementError, match="engine-0, weight-group rank 1: its expert map has no MoE layer 1"):
        expert_receivers(specs, {1: only_layer0, 2: _linear(1, 2)}, [("engine-0", [1, 2])])
    with pytest.raises(PlacementError, match="engine-0: no worker hosts expert 4 of layer 0"):
        expert_receivers(specs, {1: _linear(0, 2), 2: _linear(0, 2)}, [("engine-0", [1, 2])])


def test_layouts_and_places_are_agreed_among_each_tensors_receivers_only():
    reports = {
        "engine-0": {"workers": [
            {"member": 1, "wire_layouts": {"e0": "t16", "d": "t16"}, "wire_places": {"e0": ("w13", 0)}},
            {"member": 2, "wire_layouts": {"e4": "t16", "d": "t16"}, "wire_places": {"e4": ("w13", 0)}},
        ]},
        "engine-1": {"workers": [{"member": 3, "wire_layouts": {"e0": "t16"}, "wire_places": {"e0": ("w13", 512)}}]},
    }  # fmt: skip
    receivers = {"e0": (1, 3), "e4": (2,)}
    assert agreed_wire_layouts(reports, receivers) == {"e0": "t16", "e4": "t16"}  # d goes to 3 too, who said no
    assert agreed_wire_places(reports, receivers) == {"e4": ("w13", 0)}  # e0 lies elsewhere on rank 3
    assert agreed_wire_layouts(reports) == {}  # broadcast to everyone: nobody asked for all three alike


def test_a_worker_refuses_an_update_once_its_placement_moved():
    receiver = WeightReceiver()
    receiver.placement, receiver.member = _linear(0, 2), 1
    receiver.check_placement(_linear(0, 2))
    with pytest.raises(PlacementError, match="rank 1: the expert placement changed since this worker joined"):
        receiver.check_placement(_linear(1, 2))


def test_engines_that_move_experts_are_refused():
    pytest.importorskip("vllm")
    from megatron_rl.weights.engine.placement import refuse_moving_placement  # imports vLLM

    fixed = types.SimpleNamespace(enable_eplb=False, eplb_config=types.SimpleNamespace(num_redundant_experts=0))
    refuse_moving_placement(fixed)
    for eplb, redundant in ((True, 0), (False, 2)):
        moving = types.SimpleNamespace(
            enable_eplb=eplb, eplb_config=types.SimpleNamespace(num_redundant_experts=redundant)
        )
        with pytest.raises(PlacementError, match=f"enable_eplb={eplb}, num_redundant_experts={redundant}"):
            refuse_moving_placement(moving)
