"""Live weight sync from the trainer (every torchrun rank) to vLLM engines (Ray actors), versioned.

Rank 0 talks to the engines through Ray; every rank gathers (collectives) and each owner rank broadcasts its
buckets on its own weight group. Every remote call and transfer has a deadline, and a failure names the engine.
"""

from __future__ import annotations

import dataclasses
import json
import time

import ray
import torch.distributed as dist

from megatron_rl.errors import UserError, error_line
from megatron_rl.trainer.setup import TrainerRank
from megatron_rl.weights.lora_sync import adapter_tensors, gather_adapter_specs
from megatron_rl.weights.owners import PLACEMENT_KEY, Placement, PlacementError, expert_receivers, hosted_summary
from megatron_rl.weights.plan import (
    BucketSpec,
    TensorSpec,
    lora_plan_to_json,
    plan_buckets,
    plan_summary,
    plan_to_json,
    received_bytes,
)
from megatron_rl.weights.sender import gather_specs, send_update
from megatron_rl.weights.transport import (
    GLOO_STREAMS,
    GroupSpec,
    TransportError,
    WeightGroup,
    default_backend,
    resolve_host,
    unpacked_min_bytes,
)


class SyncError(UserError, RuntimeError):
    """A weight sync failed; the message names the engine(s) and what went wrong."""


@dataclasses.dataclass
class EngineHandle:
    """What the trainer needs of one engine: its Ray actor handle, name and number of vLLM workers."""

    name: str
    actor: object
    workers: int = 1


def engine_handles(engines: list, coordinator: bool) -> list[EngineHandle]:
    """Handles of the named engines `[(name, workers), ...]`; only the coordinator (rank 0) looks up their actors."""

    return [EngineHandle(name, ray.get_actor(name) if coordinator else None, workers) for name, workers in engines]


def ray_get_named(futures: dict[str, object], timeout_s: float, what: str) -> dict[str, object]:
    """ray.get each engine's future within one deadline; raise SyncError naming every engine that failed."""

    deadline = time.monotonic() + timeout_s
    results, failures = {}, []
    for name, future in futures.items():
        try:
            results[name] = ray.get(future, timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            failures.append(f"{name}: no answer within {timeout_s:.0f} s")
        except ray.exceptions.RayActorError as err:
            failures.append(f"{name}: engine actor died ({type(err).__name__})")
        except Exception as err:  # the engine raised: keep its own message, which names it
            failures.append(f"{name}: {error_line(err, 300)}")
    if failures:
        raise SyncError(f"{what} failed for {len(failures)} engine(s): " + "; ".join(failures))
    return results


class TrainerWeightSync:
    """Trainer side of weight sync. Construct on every rank (engines are only used on rank 0)."""

    def __init__(
        self,
        rank: TrainerRank,
        engines: list[EngineHandle],
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 300.0,
        host: str = "127.0.0.1",
        inflight: str = "keep",
        streams: int = GLOO_STREAMS,
        owner_aware: bool = True,
        lora_scale: float | None = None,
    ):
        self.rank = rank
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.host = host
        self.inflight = inflight
        self.streams = streams
        """gloo: TCP connections per member pair of each weight group (`GroupSpec.streams`)."""
        self.plan: list[BucketSpec] = []
        self.group: WeightGroup | None = None
        self.layouts: dict[str, str] = {}
        """HF name -> the wire layout every engine asked for (see `agreed_wire_layouts`); the plan follows it."""
        self.places: dict[str, tuple[str, int]] = {}
        """HF name -> where every engine holds it in that layout (see `agreed_wire_places`); the plan follows it."""
        self.plan_json = ""
        """`plan` as the engines take it, made with the plan (3 ms at 135 tensors: not before every send)."""
        self.owner_aware = owner_aware
        """Send each expert's tensors only to the engine workers that host it (expert-parallel engines); False:
        broadcast every tensor to every worker (each drops the experts it does not host)."""
        self.specs: list[TensorSpec] = []
        """Every HF tensor the trainer sends, with its owner rank (all-gathered once per `setup`)."""
        self.placements: dict[int, Placement] = {}
        """Weight-group rank -> which experts that engine worker hosts, as it published it when joining."""
        self.receivers: dict[str, tuple[int, ...]] = {}
        """HF name -> the weight-group ranks it alone goes to (`weights/owners.py`; empty unless owner-aware)."""
        self._reports: dict[str, dict] = {}
        """Rank 0: the engines' reports of the last update (what the layouts and places are agreed from)."""
        self.lora_scale = lora_scale
        """Set (alpha / rank): an adapter-only sync (`lora.sync: merge`, `weights/lora_sync.py`): only the LoRA
        adapters travel and the engines merge `W0 + lora_scale * B A` into their weights; None: full weights."""

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 talks to the engines."""
        return self.rank.ctx.rank == 0

    def _members(self, sender: int) -> tuple[str, ...]:
        workers = [f"{e.name}/worker{w}" for e in self.engines for w in range(e.workers)]
        return (f"trainer-rank{sender}", *workers)

    def engine_members(self) -> list[tuple[str, list[int]]]:
        """(engine name, the weight-group ranks of its workers) for every engine, in group order."""
        members, offset = [], 1
        for engine in self.engines:
            members.append((engine.name, list(range(offset, offset + engine.workers))))
            offset += engine.workers
        return members

    def setup(self) -> dict:
        """Plan the buckets, start the senders' stores, form every weight group with every engine worker, and plan
        again from the expert placement every worker published there."""
        r = self.rank
        backend = default_backend()
        if self.lora_scale is None:
            self.specs = gather_specs(r.model, r.family, r.arch, r.ctx)
        else:
            self.specs = gather_adapter_specs(r.model, r.arch, r.ctx)
        self.placements, self.receivers = {}, {}
        self._replan()
        senders = sorted({b.owner for b in self.plan})
        store, address = None, None
        if r.ctx.rank in senders:
            host = resolve_host(self.host)  # each sender's own address: senders sit on different nodes
            store, port = WeightGroup.host_store(host, self.timeout_s)
            address = (host, port)
        addresses: list = [None] * dist.get_world_size()
        dist.all_gather_object(addresses, address)
        specs = [GroupSpec(s, *addresses[s], self._members(s), backend, self.streams) for s in senders]
        futures = {}
        if self.is_coordinator:
            groups_json = _groups_json(specs)
            offset = 1
            for engine in self.engines:
                futures[engine.name] = engine.actor.init_weight_groups.remote(groups_json, offset, self.timeout_s)
                offset += engine.workers
        if store is not None:
            spec = next(s for s in specs if s.sender == r.ctx.rank)
            try:
                self.group = WeightGroup(spec, 0, self.timeout_s, store=store).connect()
            except TransportError as err:
                raise SyncError(str(err)) from None
        if self.is_coordinator:
            ray_get_named(futures, self.timeout_s, "joining the weight groups")
        dist.barrier()
        self._learn_placements()
        return self.summary()

    def summary(self) -> dict:
        """The plan's counts and sizes, the experts each worker hosts and the bytes each receives per update."""
        members = [m for _, ranks in self.engine_members() for m in ranks]
        return {
            **plan_summary(self.plan),
            "bucket_bytes": self.bucket_bytes,
            "owner_aware": self.owner_aware,
            "hosted": hosted_summary(self.placements),
            "received_bytes": {m: received_bytes(self.plan, m) for m in members},
        }

    def _learn_placements(self) -> None:
        """(Every rank) read the workers' placements from rank 0's group store, and plan who receives what."""
        box: list = [None]
        if self.is_coordinator:
            try:
                box = [("ok", self._published_placements())]
            except (RuntimeError, ValueError) as err:  # told to every rank, so that all fail alike
                box = [("error", f"{type(err).__name__}: {err}")]
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status != "ok":
            raise SyncError(f"reading the engines' expert placement: {value}")
        self.placements = value
        self._follow_placements()

    def _published_placements(self) -> dict[int, Placement]:
        """(Rank 0) weight-group rank -> the placement each engine worker published when it joined."""
        if self.group is None:
            raise RuntimeError("rank 0 hosts no weight group (it sends nothing), so it cannot read the placements")
        members = [m for _, ranks in self.engine_members() for m in ranks]
        placements = {}
        for member in members:
            text = self.group.published(PLACEMENT_KEY, member)
            placements[member] = json.loads(text) if text is not None else None  # unknown: send it everything
        return placements

    def _follow_placements(self) -> None:
        """(Every rank) the receivers of every expert tensor from the placements, then the plan."""
        self.receivers = self._receivers()
        self._replan()

    def _receivers(self) -> dict[str, tuple[int, ...]]:
        """The expert tensors' receivers from the placements (none unless owner-aware); SyncError naming the engine
        whose placement cannot be planned from."""
        if not self.owner_aware:
            return {}
        try:
            return expert_receivers(self.specs, self.placements, self.engine_members())
        except PlacementError as err:
            raise SyncError(str(err)) from None

    def set_owner_aware(self, owner_aware: bool) -> None:
        """(Every rank, collectively) switch between sending experts to their hosts and broadcasting everything;
        the layouts and places follow the last update's reports for the new receivers (for benchmarks)."""
        self.owner_aware = owner_aware
        self.receivers = self._receivers()
        self._follow_engines(self._agreed_now() if self.is_coordinator else None, replan=True)

    def push(self, version: int) -> dict:
        """Send the current weights as update `version`; returns timing and sizes (rank 0 adds engine reports)."""
        r = self.rank
        start = time.perf_counter()
        futures = {}
        if self.is_coordinator:
            for engine in self.engines:
                futures[engine.name] = engine.actor.update_weights.remote(
                    version, self.plan_json, self.inflight, self.timeout_s
                )
        send_error = None
        try:
            tensors = None if self.lora_scale is None else adapter_tensors(r.model, r.arch, r.ctx)
            sent = send_update(r.model, r.family, r.arch, r.ctx, self.plan, self.group, version, tensors)
        except Exception as err:  # a transfer, packing or gathering failure: the engines' answers come first
            send_error = err if isinstance(err, TransportError) else f"{type(err).__name__}: {err}"
            sent = {}
        report = {"version": version, "sent": sent}
        engines_error = None
        if self.is_coordinator:
            try:
                report["engines"] = ray_get_named(futures, self.timeout_s, f"weight update to version {version}")
                self._reports = report["engines"]
            except SyncError as err:
                engines_error = err
        # Every rank takes part in the follow-up broadcast, failed or not: a rank that raised before it left the
        # others waiting there while it entered the recovery's all-gather (one engine's death can fail one
        # rank's sends and not another's). Rank 0 sends no new agreement after a failure.
        failed = engines_error is not None or send_error is not None
        self._follow_engines(self._agreed_now() if self.is_coordinator and not failed else None)
        if engines_error is not None:  # the engines' own answers say which engine failed: before a transport error
            raise engines_error
        if send_error is not None:
            raise SyncError(f"rank {r.ctx.rank}: {send_error}")
        report["seconds"] = time.perf_counter() - start
        return report

    def _agreed_now(self) -> tuple[dict, dict]:
        """(Rank 0) the layouts and places agreed from the last reports for the current receivers."""
        reports = self._reports
        return agreed_wire_layouts(reports, self.receivers), agreed_wire_places(reports, self.receivers)

    def _replan(self) -> None:
        """Build the plan (on this rank, from the specs every rank holds) from the current layouts, places and
        receivers, and its JSON."""
        min_bytes = unpacked_min_bytes(default_backend())
        self.plan = plan_buckets(self.specs, self.bucket_bytes, min_bytes, self.layouts, self.places, self.receivers)
        lora = self.lora_scale is not None
        self.plan_json = lora_plan_to_json(self.plan, self.lora_scale) if lora else plan_to_json(self.plan)

    def _follow_engines(self, agreed: tuple[dict, dict] | None, replan: bool = False) -> None:
        """Plan again, on every rank, when the wire layouts or places the engines reported changed (rank 0
        heard them: `agreed` is (layouts, places) there), or when asked to."""
        box = [agreed]
        dist.broadcast_object_list(box, src=0)
        # None: rank 0 has no new agreement (its push failed), the current one stands
        layouts, places = box[0] if box[0] is not None else (self.layouts, self.places)
        if replan or (layouts, places) != (self.layouts, self.places):
            self.layouts, self.places = layouts, places
            self._replan()


def agreed_wire_layouts(
    engine_reports: dict[str, dict], receivers: dict[str, tuple[int, ...]] | None = None
) -> dict[str, str]:
    """HF name -> wire layout, for the tensors that every worker they go to asked to receive in the same layout
    (a broadcast reaches them all, so all must take the same bytes); from their update reports. `receivers`:
    the tensors that go only to some workers (by weight-group rank), whom alone they must suit."""
    return _agreed(engine_reports, "wire_layouts", receivers or {})


def agreed_wire_places(
    engine_reports: dict[str, dict], receivers: dict[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[str, int]]:
    """HF name -> (parameter, byte offset), for the tensors that every worker they go to holds at the same place
    in its wire layout (so that tensors lying back to back there can share a transfer); `receivers` as above."""
    places = _agreed(engine_reports, "wire_places", receivers or {})
    return {name: tuple(place) for name, place in places.items()}


def _agreed(engine_reports: dict[str, dict], key: str, receivers: dict[str, tuple[int, ...]]) -> dict:
    """The entries of `key` that every reporting worker a tensor goes to reported with the same value.

    Only an optimisation rides on it (a worker that does not take a tensor in the agreed layout or place puts
    it back into its own from its buffer), so workers whose reports did not come back (vLLM returns only the
    first data-parallel replica's) are left out."""
    workers = [worker for report in engine_reports.values() for worker in report.get("workers", [])]
    if not workers:
        return {}
    if not receivers or any("member" not in w for w in workers):
        receivers = {}
    names = set().union(*(worker.get(key, {}) for worker in workers))
    agreed = {}
    for name in names:
        owners = receivers.get(name)
        values = [w.get(key, {}).get(name) for w in workers if owners is None or w["member"] in owners]
        if values and values[0] is not None and all(value == values[0] for value in values):
            agreed[name] = values[0]
    return agreed


def _groups_json(specs: list[GroupSpec]) -> str:

    return json.dumps([s.to_dict() for s in specs])
