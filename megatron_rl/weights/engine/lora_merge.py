"""Adapter-only updates on the engine (`lora.sync: merge`): keep `W0`, merge `W0 + scale * B A`, load in place.

An adapter-only update's buckets carry peft-named LoRA tensors (`model.layers.0.self_attn.q_proj.lora_A.weight`,
`...q_proj.lora_B.weight`; experts per expert), not weights (`weights/lora_sync.py`). `LoraMerge` stands in for
the worker's `InPlaceWeightLoader` while the receiver takes them: it keeps a copy of each, and when the update is
finished it computes, per HF module, `W = W0 + scale * B @ A` (in float32, then in `W0`'s dtype) and loads the
merged HF tensors through the loader, layer by layer, as one update (`begin_update(partial=True)`: the layers the
update does not touch keep their weights), so vLLM's own sharding and fusing (q/k/v, gate/up, experts) applies.

`W0` is the base checkpoint the engine started from: `BaseWeights` reads each adapted HF weight from its
safetensors at first use, casts it to the engine's dtype and keeps it, so the base is never sent and a merge never
builds on the last one. Memory: one copy of every adapted HF weight per worker, whole (not the worker's shard:
vLLM's loaders cut the full tensors), plus, for an MoE layer with any expert adapter, the other expert weights of
the experts the worker hosts (an expert layer is loaded whole: vLLM processes its gate/up and down tensors together).
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from megatron_rl.weights.engine.loader import InPlaceWeightLoader

ADAPTER_NAME = re.compile(r"^(?P<stem>.+)\.lora_(?P<which>[AB])\.weight$")
"""A peft adapter tensor's name without `base_model.model.`: `<HF module>.lora_A.weight` / `.lora_B.weight`."""
_EXPERT_WEIGHT = re.compile(r"^(?P<expert>.+\.experts\.\d+\.)[^.]+\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class LoraMergeError(ValueError):
    """An adapter-only update that cannot be merged; names the tensor and what is wrong."""


class BaseWeights:
    """The base HF weights `W0` of the engine's checkpoint folder, read at first use and kept, in `dtype`."""

    def __init__(self, folder: str | Path, dtype: torch.dtype):
        self.folder = Path(folder)
        self.dtype = dtype
        self.kept: dict[str, torch.Tensor] = {}
        """HF name -> W0 (in `dtype`), for every weight an update has merged or loaded so far."""
        self._files: dict[str, Path] | None = None

    def files(self) -> dict[str, Path]:
        """HF name -> the safetensors file that holds it (from the headers, read once)."""
        if self._files is None:
            found = sorted(self.folder.glob("*.safetensors")) if self.folder.is_dir() else []
            if not found:
                raise LoraMergeError(
                    f"an adapter-only update merges onto the engine's base checkpoint, but {self.folder} is no local"
                    f" folder of safetensors files: start the engine from a local checkpoint folder"
                )
            files = {}
            for file in found:
                with safe_open(str(file), framework="pt") as handle:
                    files |= dict.fromkeys(handle.keys(), file)  # noqa: SIM118 (not a dict)
            self._files = files
        return self._files

    def get(self, name: str) -> torch.Tensor:
        """W0 of HF weight `name` (read on first use); LoraMergeError when the checkpoint lacks it."""
        tensor = self.kept.get(name)
        if tensor is None:
            file = self.files().get(name)
            if file is None:
                raise LoraMergeError(f"adapted weight {name!r} is not in the engine's checkpoint {self.folder}")
            with safe_open(str(file), framework="pt") as handle:
                tensor = handle.get_tensor(name).to(self.dtype).contiguous()
            self.kept[name] = tensor
        return tensor

    def expert_weights(self, prefix: str) -> list[str]:
        """Every weight of the checkpoint under one expert's prefix (`model.layers.1.mlp.experts.3.`)."""
        return sorted(n for n in self.files() if n.startswith(prefix) and n.endswith(".weight"))

    @property
    def nbytes(self) -> int:
        """Bytes of the kept W0 copies."""
        return sum(t.numel() * t.element_size() for t in self.kept.values())


def adapter_pairs(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name (`<module>.weight`) -> (A, B) of its adapter; LoraMergeError naming a tensor without its
    partner or one that is no adapter tensor."""
    halves: dict[str, dict[str, torch.Tensor]] = collections.defaultdict(dict)
    for name, tensor in adapters.items():
        match = ADAPTER_NAME.match(name)
        if match is None:
            raise LoraMergeError(f"tensor {name!r} in an adapter-only update is no LoRA tensor (lora_A / lora_B)")
        halves[match["stem"] + ".weight"][match["which"]] = tensor
    pairs = {}
    for weight, half in halves.items():
        if set(half) != {"A", "B"}:
            lacking = ({"A", "B"} - set(half)).pop()
            raise LoraMergeError(f"the update carried no lora_{lacking} for {weight!r} (adapter tensors come in pairs)")
        pairs[weight] = (half["A"], half["B"])
    return pairs


def merged(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, name: str) -> torch.Tensor:
    """`W0 + scale * B @ A` in float32, returned in W0's dtype; LoraMergeError naming the weight on a shape
    mismatch (W0 [out, in], A [r, in], B [out, r])."""
    if (
        a.dim() != 2
        or b.dim() != 2
        or w0.dim() != 2
        or b.shape[1] != a.shape[0]
        or (b.shape[0], a.shape[1]) != w0.shape
    ):
        raise LoraMergeError(
            f"adapter of {name!r}: lora_B {list(b.shape)} @ lora_A {list(a.shape)} does not give the weight's shape"
            f" {list(w0.shape)}"
        )
    a, b = a.to(w0.device, torch.float32), b.to(w0.device, torch.float32)
    if w0.dtype == torch.float32:
        return torch.addmm(w0, b, a, alpha=scale)  # one pass, a new tensor (W0 stays)
    return torch.addmm(w0.float(), b, a, alpha=scale).to(w0.dtype)


def by_layer(names: Iterable[str]) -> list[list[str]]:
    """The names grouped by decoder layer, in layer order (names outside the layers first)."""
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for name in names:
        match = _LAYER.search(name)
        groups[int(match[1]) if match else -1].append(name)
    return [groups[layer] for layer in sorted(groups)]


class LoraMerge:
    """Stands in for the worker's `InPlaceWeightLoader` during an adapter-only update (see module doc): takes the
    buckets' adapter tensors, then merges onto `W0` and loads the merged weights at `finish`."""

    def __init__(self, loader: InPlaceWeightLoader, base: BaseWeights, scale: float = 0.0):
        self.loader, self.base, self.scale = loader, base, scale
        self.adapters: dict[str, torch.Tensor] = {}
        """peft name -> the adapter tensor of the current update (copied out of its bucket)."""
        self.timings: dict[str, float] = {}
        """Seconds of the last update's phases (the loader's, and `merge_s`)."""
        self.merged_weights = 0
        """HF weights the last update merged (its loads also hold the W0 of an expert's unadapted weights)."""

    def begin_update(self) -> None:
        """Start an update (again after a failed one): forget the adapters taken so far."""
        self.adapters = {}

    def direct_destination(self, name: str, layout: str, shape: Sequence[int], dtype: str) -> None:
        """Nothing is received straight into the model: adapters come through the buckets."""
        return None

    def wire_layouts(self) -> dict[str, str]:
        """No wire layouts: adapters travel in their own (row-major) layout."""
        return {}

    def wire_places(self) -> dict[str, tuple[str, int]]:
        """None either (see `wire_layouts`)."""
        return {}

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], placed: Iterable[str] = ()) -> int:
        """Take one bucket's adapter tensors (copies: the bucket's buffer is reused); returns how many."""
        count = 0
        for name, tensor in named_tensors:
            if ADAPTER_NAME.match(name) is None:
                raise LoraMergeError(f"tensor {name!r} in an adapter-only update is no LoRA tensor (lora_A / lora_B)")
            self.adapters[name] = tensor.clone()
            count += 1
        return count

    @torch.no_grad()
    def finish(self) -> None:
        """Merge every adapted weight onto W0 and load the merged weights in place, layer by layer, as one update
        of the loader (the weights of the layers it does not touch stay)."""
        start = time.perf_counter()
        pairs = adapter_pairs(self.adapters)
        names = set(pairs)
        for weight in pairs:  # an expert layer is processed whole: the unadapted expert weights go as W0
            expert = _EXPERT_WEIGHT.match(weight)
            if expert is not None:
                names.update(self.base.expert_weights(expert["expert"]))
        merge_s = 0.0
        self.loader.begin_update(partial=True)
        for group in by_layer(sorted(names)):
            merge_start = time.perf_counter()
            tensors = []
            for name in group:
                w0 = self.base.get(name)
                a_b = pairs.get(name)
                tensors.append((name, w0 if a_b is None else merged(w0, *a_b, self.scale, name)))
            merge_s += time.perf_counter() - merge_start
            self.loader.load(tensors)
        self.loader.finish()
        self.merged_weights = len(pairs)
        self.adapters = {}
        self.timings = {**self.loader.timings, "merge_s": merge_s, "lora_finish_s": time.perf_counter() - start}

    def describe(self) -> dict:
        """Counts and bytes: merged weights of the last update, kept W0 copies."""
        return {
            "merged_weights": self.merged_weights,
            "kept_w0": len(self.base.kept),
            "kept_w0_bytes": self.base.nbytes,
        }
