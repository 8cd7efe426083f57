"""Which engine workers need which expert tensors: the owner-aware part of the plan, pure.

Under vLLM's expert parallelism each engine worker hosts only some experts of every MoE layer (its expert map),
so an expert's tensors need to reach only those workers. Every worker publishes its placement when it joins
the weight groups (`weights/engine/placement.py`: global (HF) layer index -> the global experts it hosts, or
None when it hosts every expert, as a worker of an engine without expert parallelism does); from these the
trainer computes, for every expert tensor, the weight-group ranks of its owners (`expert_receivers`), and the
plan sends it to them alone. Imports no torch: both the trainer and the engine workers use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_rl.errors import UserError
from megatron_rl.weights.plan import TensorSpec

PLACEMENT_KEY = "placement"
"""Under this key (and its group rank) each engine worker publishes its placement (JSON) on every weight group's
store when it joins (`engine/receiver.py`); the trainer's rank 0 reads them from its own group's store."""
Placement = dict | None
"""One worker's placement as it publishes it: {"layers": {"<layer>": [global expert ids]}, "experts": number of
global experts, "ep_rank", "ep_size", "strategy"}; None: it hosts every expert."""


class PlacementError(UserError, ValueError):
    """An engine's expert placement that the owner-aware sync cannot plan from; the message names engine, worker,
    layer or expert."""


def hosts(placement: Placement, layer: int, expert: int) -> bool:
    """Whether a worker with `placement` hosts `expert` of `layer`."""
    if placement is None:
        return True
    return expert in placement["layers"].get(str(layer), ())


def expert_receivers(
    specs: Sequence[TensorSpec],
    placements: Mapping[int, Placement],
    engines: Sequence[tuple[str, Sequence[int]]],
) -> dict[str, tuple[int, ...]]:
    """HF name -> weight-group ranks of the workers that host it, for every expert tensor that not every worker
    hosts (a tensor every worker needs keeps travelling by broadcast, so engines without expert parallelism get
    today's plan).

    `placements`: weight-group rank -> that worker's placement; `engines`: (engine name, its workers' ranks).
    Raises PlacementError when an expert-parallel worker's map lacks an MoE layer the trainer has, or when some
    expert of a layer is hosted by none of an engine's workers (its weights would never be updated there).
    """
    members = sorted(r for _, ranks in engines for r in ranks)
    _check_placements(specs, placements, engines)
    receivers: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        if not spec.is_expert or spec.layer is None or spec.expert is None:
            continue
        owners = tuple(r for r in members if hosts(placements.get(r), spec.layer, spec.expert))
        if owners != tuple(members):
            receivers[spec.name] = owners
    return receivers


def _check_placements(
    specs: Sequence[TensorSpec], placements: Mapping[int, Placement], engines: Sequence[tuple[str, Sequence[int]]]
) -> None:
    """Raise PlacementError for a layer missing from a worker's map or an expert no worker of an engine hosts."""
    experts = {(s.layer, s.expert) for s in specs if s.is_expert and s.layer is not None and s.expert is not None}
    layers = sorted({layer for layer, _ in experts})
    for name, ranks in engines:
        for rank in ranks:
            placement = placements.get(rank)
            missing = [layer for layer in layers if placement is not None and str(layer) not in placement["layers"]]
            if missing:
                raise PlacementError(
                    f"engine {name}, weight-group rank {rank}: its expert map has no MoE layer {missing[0]} (it has "
                    f"{sorted(placement['layers'], key=int)[:8]}); the trainer's model and the engine's differ"
                )
        orphans = sorted(e for e in experts if not any(hosts(placements.get(r), *e) for r in ranks))
        if orphans:
            layer, expert = orphans[0]
            raise PlacementError(
                f"engine {name}: no worker hosts expert {expert} of layer {layer} ({len(orphans)} experts unhosted); "
                "its weights could never be updated there"
            )


def hosted_summary(placements: Mapping[int, Placement]) -> dict[int, str]:
    """Weight-group rank -> which experts it hosts, briefly ("all", or the first layer's experts and strategy), for
    reports and logs."""
    out = {}
    for rank, placement in sorted(placements.items()):
        if placement is None:
            out[rank] = "all"
            continue
        first = min(placement["layers"], key=int) if placement["layers"] else None
        hosted = placement["layers"].get(first, []) if first is not None else []
        out[rank] = f"{len(hosted)}/{placement.get('experts', '?')} ({placement.get('strategy', '?')}): {hosted}"
    return out
