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

from megatron_rl.errors import UserError
from megatron_rl.trainer.setup import TrainerRank
from megatron_rl.weights.plan import BucketSpec, plan_summary, plan_to_json
from megatron_rl.weights.sender import build_plan, send_update
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
            failures.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
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

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 talks to the engines."""
        return self.rank.ctx.rank == 0

    def _members(self, sender: int) -> tuple[str, ...]:
        workers = [f"{e.name}/worker{w}" for e in self.engines for w in range(e.workers)]
        return (f"trainer-rank{sender}", *workers)

    def setup(self) -> dict:
        """Plan the buckets, start the senders' stores, and form every weight group with every engine worker."""
        r = self.rank
        backend = default_backend()
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
        return {**plan_summary(self.plan), "bucket_bytes": self.bucket_bytes}

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
            sent = send_update(r.model, r.family, r.arch, r.ctx, self.plan, self.group, version)
        except Exception as err:  # a transfer, packing or gathering failure: the engines' answers come first
            send_error = err if isinstance(err, TransportError) else f"{type(err).__name__}: {err}"
            sent = {}
        report = {"version": version, "sent": sent}
        if self.is_coordinator:
            # The engines' own answers say which engine failed, so they come before a transport error.
            report["engines"] = ray_get_named(futures, self.timeout_s, f"weight update to version {version}")
        if send_error is not None:
            raise SyncError(f"rank {r.ctx.rank}: {send_error}")
        agreed = None
        if self.is_coordinator:
            agreed = (agreed_wire_layouts(report["engines"]), agreed_wire_places(report["engines"]))
        self._follow_engines(agreed)
        report["seconds"] = time.perf_counter() - start
        return report

    def _replan(self) -> None:
        """Build the plan (a collective: every rank) from the current layouts and places, and its JSON."""
        r = self.rank
        min_bytes = unpacked_min_bytes(default_backend())
        self.plan = build_plan(
            r.model, r.family, r.arch, r.ctx, self.bucket_bytes, min_bytes, self.layouts, self.places
        )
        self.plan_json = plan_to_json(self.plan)

    def _follow_engines(self, agreed: tuple[dict, dict] | None) -> None:
        """Plan again, on every rank, when the wire layouts or places the engines reported changed (rank 0
        heard them: `agreed` is (layouts, places) there)."""
        box = [agreed]
        dist.broadcast_object_list(box, src=0)
        layouts, places = box[0]
        if (layouts, places) != (self.layouts, self.places):
            self.layouts, self.places = layouts, places
            self._replan()


def agreed_wire_layouts(engine_reports: dict[str, dict]) -> dict[str, str]:
    """HF name -> wire layout, for the tensors that every worker of every engine asked to receive in the same
    layout (a broadcast reaches them all, so all must take the same bytes); from their update reports."""
    return _agreed(engine_reports, "wire_layouts")


def agreed_wire_places(engine_reports: dict[str, dict]) -> dict[str, tuple[str, int]]:
    """HF name -> (parameter, byte offset), for the tensors that every worker of every engine holds at the same
    place in its wire layout (so that tensors lying back to back there can share a broadcast)."""
    return {name: tuple(place) for name, place in _agreed(engine_reports, "wire_places").items()}


def _agreed(engine_reports: dict[str, dict], key: str) -> dict:
    """The entries of `key` that every worker of every engine reported with the same value."""
    workers = [worker for report in engine_reports.values() for worker in report.get("workers", [])]
    if not workers:
        return {}
    agreed = dict(workers[0].get(key, {}))
    for worker in workers[1:]:
        theirs = worker.get(key, {})
        agreed = {name: value for name, value in agreed.items() if theirs.get(name) == value}
    return agreed


def _groups_json(specs: list[GroupSpec]) -> str:

    return json.dumps([s.to_dict() for s in specs])
