"""vLLM worker extension for in-place weight updates: the engine's end of `weights/sync.py`.

vLLM mixes the class that `EngineSpec.worker_extension` names (`worker_extension_cls`; default `EXTENSION`, this
module's `WeightUpdateExtension`) into each of its workers, and `collective_rpc(name, args)` calls one of its
methods on every worker. Callers name the methods by the constants below (`INIT_WEIGHT_GROUPS`, ...), never by
bare strings. Tensors cannot travel through `collective_rpc`, so an update comes over the weight groups
(`receiver.py`) and goes into the model through the loader (`loader.py`). Tests and the benchmark add their own
RPCs in subclasses (`tests/support/weight_extension.py`, `bench/weight_sync_baseline.py`).

Every attribute here is prefixed `mrl_`: vLLM refuses an extension whose attribute names clash with the
worker's.

The launcher imports this module (through `rollout/engine.py`) for the names: it imports no vLLM, so the loader
(which does) is imported where the first worker makes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.parallel.patches import applied_vllm_patches
from megatron_rl.weights.engine.lora_adapter import LoraAdapterFolder
from megatron_rl.weights.engine.lora_merge import BaseWeights, LoraMerge
from megatron_rl.weights.engine.receiver import WeightReceiver
from megatron_rl.weights.engine.router_bias import RouterBias
from megatron_rl.weights.engine.routes import RouteCapture
from megatron_rl.weights.plan import lora_of_plan

if TYPE_CHECKING:
    from megatron_rl.weights.engine.loader import InPlaceWeightLoader


class WeightUpdateExtension:
    """Methods added to the vLLM worker (`self` is the worker: it has `model_runner`)."""

    def mrl_weight_loader(self) -> InPlaceWeightLoader:
        """The worker's loader, created on first use for the model the worker runs."""
        loader = getattr(self, "_mrl_loader", None)
        if loader is None:
            # Here, not at the top: the loader imports vLLM, and the launcher imports this module (module doc).
            from megatron_rl.weights.engine.loader import InPlaceWeightLoader, checkpoint_shapes

            model_config = self.model_runner.model_config
            parallel = self.model_runner.vllm_config.parallel_config
            # Under pipeline or expert parallel inference a rank legitimately ignores other ranks' tensors.
            distributed = parallel.pipeline_parallel_size > 1 or getattr(parallel, "enable_expert_parallel", False)
            # Updates share the layout of the checkpoint the engine started from (when it is a local folder).
            shapes = checkpoint_shapes(model_config.model) if Path(model_config.model).is_dir() else {}
            loader = InPlaceWeightLoader(
                self.model_runner.get_model(),
                act_dtype=model_config.dtype,
                strict=not distributed,
                expected_shapes=shapes or None,
            )
            self._mrl_loader = loader
        return loader

    def mrl_describe_weight_loader(self) -> dict:
        """Loader mode, counts of prepacked parameters, and the vLLM patches applied in this worker (picklable)."""
        return {**self.mrl_weight_loader().describe(), "vllm_patches": applied_vllm_patches()}

    def mrl_init_weight_groups(self, groups_json: str, rank_offset: int, timeout_s: float) -> dict:
        """Join every trainer sender's weight group as member `rank_offset + this worker's index in the engine`,
        publishing which experts this worker hosts (`mrl_expert_placement`) for the trainer's plan."""
        receiver = getattr(self, "_mrl_receiver", None) or WeightReceiver()
        self._mrl_receiver = receiver
        placement = self.mrl_expert_placement()  # before joining: an engine that moves experts is refused
        self.mrl_weight_loader().prepare()  # memory for the updates, before the first one
        return receiver.join(groups_json, rank_offset + self.mrl_worker_index(), timeout_s, placement)

    def mrl_expert_placement(self) -> dict | None:
        """Which global experts this worker hosts per MoE layer, from vLLM's expert maps (None: every expert);
        PlacementError for an engine whose placement moves (EPLB). See `placement.py`."""
        maps = getattr(self, "_mrl_expert_maps", None)
        if maps is None:
            # Here, not at the top: it imports vLLM, and the launcher imports this module (module doc).
            from megatron_rl.weights.engine.placement import ExpertMaps

            maps = ExpertMaps(self.model_runner.get_model(), self.model_runner.vllm_config.parallel_config)
            self._mrl_expert_maps = maps
        return maps.placement()

    def mrl_worker_index(self) -> int:
        """This worker's index among all workers of its engine: data-parallel replica, then rank within it.

        vLLM's `self.rank` counts within one data-parallel replica only (vLLM 0.32 multiproc executor), so with
        `data_parallel_size > 1` replicas would otherwise claim the same group ranks.
        """
        parallel = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        replica, per_replica = (parallel.data_parallel_rank, parallel.world_size) if parallel else (0, 1)
        return replica * per_replica + int(getattr(self, "rank", 0))

    def mrl_weight_receiver(self) -> WeightReceiver:
        """The worker's receiver (its weight groups); RuntimeError before `mrl_init_weight_groups`."""
        receiver = getattr(self, "_mrl_receiver", None)
        if receiver is None:
            raise RuntimeError(f"weight transfer before {INIT_WEIGHT_GROUPS}")
        return receiver

    def mrl_receive_update(self, version: int, plan_json: str) -> dict:
        """Receive update `version` (every bucket of the plan that reaches this worker) over the weight groups and
        load it in place, once the expert placement is checked to be the one the plan was made from."""
        receiver = self.mrl_weight_receiver()
        receiver.check_placement(self.mrl_expert_placement())
        lora = lora_of_plan(plan_json)
        if lora is None:
            return receiver.receive(version, plan_json, self.mrl_weight_loader())
        folder = getattr(self, "_mrl_lora_folder", None)  # lora.sync=vllm: a PEFT folder for vLLM, no merge
        merge = folder if folder is not None else self.mrl_lora_merge()
        merge.scale = float(lora["scale"])
        if folder is not None:
            folder.version = version
        return {**receiver.receive(version, plan_json, merge), "lora": merge.describe()}

    def mrl_set_lora_folder(self, root: str) -> dict:
        """Serve adapter-only updates as vLLM LoRA adapters from now on (`lora.sync: vllm`, `lora_adapter.py`):
        the engine's first worker writes each as a PEFT folder under `root`; the others only check theirs."""
        writes = self.mrl_worker_index() == 0
        self._mrl_lora_folder = LoraAdapterFolder(root, writes, self.model_runner.model_config.model)
        return {"root": root, "writes": writes}

    def mrl_lora_merge(self) -> LoraMerge:
        """The worker's adapter-only updates (`lora_merge.py`): W0 of the checkpoint the engine started from, in
        its dtype, merged with each update's adapters and loaded through the worker's loader."""
        merge = getattr(self, "_mrl_lora_merge", None)
        if merge is None:
            model_config = self.model_runner.model_config
            merge = LoraMerge(self.mrl_weight_loader(), BaseWeights(model_config.model, model_config.dtype))
            self._mrl_lora_merge = merge
        return merge

    def mrl_finish_weight_update(self) -> None:
        """End the current update (see `InPlaceWeightLoader.finish`)."""
        self.mrl_weight_loader().finish()

    def mrl_start_route_capture(self, max_finished_bytes: int = 512 << 20) -> dict:
        """Capture every MoE layer's routed experts per request from now on (`routes.py`); again: its report."""
        capture = getattr(self, "_mrl_routes", None)
        if capture is None:
            capture = RouteCapture(self.model_runner, max_finished_bytes)
            self._mrl_routes = capture
        return capture.describe()

    def mrl_route_capture(self) -> RouteCapture:
        """The worker's route capture; RuntimeError before `mrl_start_route_capture`."""
        capture = getattr(self, "_mrl_routes", None)
        if capture is None:
            raise RuntimeError(f"routes asked for before {START_ROUTE_CAPTURE}")
        return capture

    def mrl_fetch_routes(self, request_ids: list[str]) -> dict:
        """The routes of these requests (the ids given to vLLM), removed from the worker (`RouteStore.pop`)."""
        return self.mrl_route_capture().fetch(request_ids)

    def mrl_drop_routes(self, request_ids: list[str]) -> int:
        """Forget these requests' routes (aborted ones nobody will fetch)."""
        return self.mrl_route_capture().drop(request_ids)

    def mrl_perturb_routing(self, scale: float, seed: int = 0) -> dict:
        """Perturb every MoE router's top-k selection (not its gate weights) from now on (`router_bias.py`; a
        second call installs the new perturbation over the first); its report. Refused on a compiled model, whose
        graphs would go on running the routers as they were when compiled."""
        if not self.model_runner.model_config.enforce_eager:
            raise RuntimeError(f"{PERTURB_ROUTING} needs an eager engine (EngineSpec.enforce_eager=True)")
        self._mrl_router_bias = RouterBias(self.model_runner.get_model(), scale, seed)
        return {**self._mrl_router_bias.describe(), "answers": self.mrl_first_tp_rank()}

    def mrl_routing_flips(self, reset: bool = True) -> dict:
        """(token, layer) pairs the perturbed routers routed since the last reset, and how many choices flipped;
        `answers` is False on the TP peers, which routed the same tokens."""
        bias = getattr(self, "_mrl_router_bias", None)
        if bias is None:
            raise RuntimeError(f"routing flips before {PERTURB_ROUTING}")
        return {**bias.take_counts(reset), "answers": self.mrl_first_tp_rank()}

    def mrl_first_tp_rank(self) -> bool:
        """Whether this worker is the first of its tensor-parallel group (TP peers route identically)."""
        # Here, not at the top: it imports vLLM, and the launcher imports this module (module doc).
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().is_first_rank


EXTENSION = f"{WeightUpdateExtension.__module__}.{WeightUpdateExtension.__qualname__}"
"""The production extension by qualified name (vLLM's `worker_extension_cls` takes a name)."""
INIT_WEIGHT_GROUPS = WeightUpdateExtension.mrl_init_weight_groups.__name__
"""RPC: join the trainer senders' weight groups (args: groups JSON, rank offset, timeout in seconds)."""
RECEIVE_UPDATE = WeightUpdateExtension.mrl_receive_update.__name__
"""RPC: receive and load one whole update (args: version, plan JSON); returns the worker's report."""
SET_LORA_FOLDER = WeightUpdateExtension.mrl_set_lora_folder.__name__
"""RPC: take adapter-only updates as vLLM LoRA adapters written under a folder (args: the folder)."""
FINISH_WEIGHT_UPDATE = WeightUpdateExtension.mrl_finish_weight_update.__name__
"""RPC: end the current update (after loads made by other RPCs)."""
DESCRIBE_WEIGHT_LOADER = WeightUpdateExtension.mrl_describe_weight_loader.__name__
"""RPC: the loader's mode and counts, and the vLLM patches applied."""
START_ROUTE_CAPTURE = WeightUpdateExtension.mrl_start_route_capture.__name__
"""RPC: capture each MoE layer's routed experts per request from now on (args: optional byte budget of finished
requests' routes); returns each worker's report."""
FETCH_ROUTES = WeightUpdateExtension.mrl_fetch_routes.__name__
"""RPC: the routes of requests by id, freed on the workers (args: list of ids); merge the per-worker results with
`routes.merge_worker_routes`."""
DROP_ROUTES = WeightUpdateExtension.mrl_drop_routes.__name__
"""RPC: forget requests' routes (args: list of ids)."""
PERTURB_ROUTING = WeightUpdateExtension.mrl_perturb_routing.__name__
"""RPC: perturb the MoE routers' top-k selection, not their gate weights (args: scale, seed); each worker's
report (`verify routing`)."""
ROUTING_FLIPS = WeightUpdateExtension.mrl_routing_flips.__name__
"""RPC: each worker's counts of routed (token, layer) pairs and of flipped choices since the last reset (args:
reset); sum those that answer."""
EXPERT_PLACEMENT = WeightUpdateExtension.mrl_expert_placement.__name__
"""RPC: which experts each worker hosts (only the first data-parallel replica's workers answer through
`collective_rpc`; the sync reads every worker's from the weight groups' stores)."""
