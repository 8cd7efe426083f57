"""The pure weight-sync plan and the bucket packer."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import get_family
from megatron_rl.parallel.layout import ParallelLayout, rank_coords
from megatron_rl.weights.buckets import BucketError, leave_a_core_to_transport, pack, unpack
from megatron_rl.weights.plan import ALIGN, HEADER_BYTES, TensorSpec, owner_rank, plan_buckets, tensor_specs


def _arch(family="qwen3_moe"):
    fam = get_family(family)
    return fam, fam.arch_from_hf(fam.tiny_hf_config(512))


@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(), ParallelLayout(tp=2, ep=2), ParallelLayout(pp=2, ep=2), ParallelLayout(tp=2, pp=2, ep=2, dp=2)],
)
def test_owner_matches_gather_rule(layout):
    """The planned owner is the rank that weights/gather.py lets yield the tensor (tp0/dp0 or etp0/edp0)."""
    fam, arch = _arch()
    for rule in fam.rule_table(arch).values():
        coords = rank_coords(layout, owner_rank(rule, arch, layout))
        if rule.is_expert:
            assert (coords.etp, coords.edp) == (0, 0)
            per = arch.num_experts // layout.ep
            assert coords.ep == rule.expert // per
        else:
            assert (coords.tp, coords.dp) == (0, 0)
        if rule.layer is not None:
            assert coords.pp == rule.layer // (arch.num_layers // layout.pp)


def _specs(sizes, owner=0, expert=False):
    return [TensorSpec(f"t{i}", (n,), "float32", owner, expert) for i, n in enumerate(sizes)]


def test_buckets_respect_budget_alignment_and_order():
    specs = _specs([10, 20, 300, 5], owner=0) + _specs([7, 7], owner=1) + [TensorSpec("e0", (8,), "bfloat16", 0, True)]
    specs[4:6] = [TensorSpec(f"o{i}", (7,), "float32", 1, False) for i in range(2)]
    buckets = plan_buckets(specs, bucket_bytes=256)
    names = [[s.name for s in b.slots] for b in buckets]
    assert names == [["t0", "t1"], ["t2"], ["t3"], ["o0", "o1"], ["e0"]]
    assert [b.owner for b in buckets] == [0, 0, 0, 1, 0]
    assert [b.is_expert for b in buckets] == [False, False, False, False, True]
    for bucket in buckets:
        assert all(s.offset % ALIGN == 0 and s.offset >= HEADER_BYTES for s in bucket.slots)
        assert bucket.nbytes >= max(s.offset + s.nbytes for s in bucket.slots)
        payload = sum(s.nbytes for s in bucket.slots)
        assert payload <= 256 or len(bucket.slots) == 1


def test_plan_covers_every_tensor_once():
    fam, arch = _arch("deepseek_v3")
    rules = fam.rule_table(arch)
    names = [n for r in rules.values() for n in r.hf]
    specs = tensor_specs(
        rules, {n: (4, 4) for n in names}, {n: "float32" for n in names}, arch, ParallelLayout(pp=2, ep=2)
    )
    buckets = plan_buckets(specs, 1024)
    planned = [s.name for b in buckets for s in b.slots]
    assert sorted(planned) == sorted(names)
    first_expert = next(i for i, b in enumerate(buckets) if b.is_expert)
    assert all(b.is_expert for b in buckets[first_expert:])


def test_pack_unpack_round_trip_mixed_dtypes():
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6, dtype=torch.int64)}
    specs = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), 0, False) for n, t in tensors.items()]
    (bucket,) = plan_buckets(specs, 1 << 20)
    buffer = torch.empty(bucket.nbytes + 100, dtype=torch.uint8)
    wire = pack(buffer, bucket, tensors, version=3)
    received = dict(unpack(wire.clone(), bucket, version=3))
    assert all(torch.equal(received[n], tensors[n]) for n in tensors)
    with pytest.raises(BucketError, match="version=4"):
        list(unpack(wire, bucket, version=4))
    with pytest.raises(ValueError, match="a: got \\(5, 3\\)"):
        pack(buffer, bucket, {**tensors, "a": torch.randn(5, 3)}, version=3)


def test_a_core_is_left_to_the_transport_on_cpu_only_while_buckets_fly():
    threads = torch.get_num_threads()
    with leave_a_core_to_transport("cpu"):
        assert torch.get_num_threads() == max(1, threads - 1)
    assert torch.get_num_threads() == threads
    with leave_a_core_to_transport("meta"):
        assert torch.get_num_threads() == threads
