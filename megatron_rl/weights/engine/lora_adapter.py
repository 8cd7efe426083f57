"""Adapter-only updates on the engine in `lora.sync: vllm` mode: the adapters become a PEFT folder for vLLM.

The buckets carry the same peft-named LoRA tensors as in merge mode (`lora_merge.py`), and `LoraAdapterFolder`
takes them the same way (it stands in for the worker's loader). At `finish`, instead of merging onto `W0`, the
engine's first worker writes them as a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`:
`base_model.model.` + the HF name, `r`, `lora_alpha` = scale * r, `target_modules`) under the folder the engine gave
(`root/v<version>`); the engine then serves every request with a new vLLM `LoRARequest` on that path
(`rollout/engine_lora.py`), whose loading every worker does from the same files. The base weights are untouched:
no copy of `W0` is kept. Dense targets only: an expert adapter is refused here (vLLM's CPU fused-MoE experts take
no LoRA). The other workers only check what they received.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_rl.weights.engine.lora_merge import LoraMerge, LoraMergeError, adapter_pairs

PEFT_PREFIX = "base_model.model."
"""peft's prefix of every adapter tensor's name (the same as `weights/peft_export.PEFT_PREFIX`)."""
KEEP_FOLDERS = 2
"""Adapter folders kept on disk: the one being served and the one before it (the rest are removed)."""


def write_peft_folder(
    folder: Path, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, base: str
) -> int:
    """Write HF weight name -> (A, B) pairs as a PEFT adapter folder for vLLM (dense modules only); the rank.

    LoraMergeError naming the tensor for an expert adapter or pairs of different ranks."""
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise LoraMergeError(f"adapters of different ranks {sorted(ranks)} in one update; vLLM takes one rank")
    rank = ranks.pop()
    tensors, modules = {}, set()
    for weight, (a, b) in sorted(pairs.items()):
        if ".experts." in weight:
            raise LoraMergeError(
                f"adapter of {weight!r} is on a routed expert, which lora.sync=vllm cannot serve (vLLM's fused MoE"
                f" experts take no LoRA): use lora.sync=merge"
            )
        stem = weight.removesuffix(".weight")
        modules.add(stem.rsplit(".", 1)[-1])
        tensors[f"{PEFT_PREFIX}{stem}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{stem}.lora_B.weight"] = b.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": scale * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "target_modules": sorted(modules),
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return rank


class LoraAdapterFolder(LoraMerge):
    """Stands in for the worker's loader during an adapter-only update in vllm mode (module doc): takes the
    buckets' adapter tensors like `LoraMerge`, then (`writes`: the engine's first worker) writes them as a PEFT
    folder `root/v<version>` at `finish`."""

    def __init__(self, root: str | Path, writes: bool, base: str):
        super().__init__(loader=None, base=None)  # type: ignore[arg-type]  (neither is used: nothing is merged)
        self.root, self.writes, self.base_path = Path(root), writes, base
        self.version = 0
        """The version of the update being received (set before it is)."""
        self.path: str | None = None
        """The folder the last update was written to (None on the workers that do not write)."""
        self.rank = 0
        """The adapters' rank in the last update."""

    def begin_update(self) -> None:
        """Start an update: forget the adapters taken so far."""
        self.adapters = {}

    def finish(self) -> None:
        """Check the adapters come in pairs; the writer writes them as `root/v<version>` and removes old folders."""
        pairs = adapter_pairs(self.adapters)
        if not pairs:
            raise LoraMergeError("an adapter-only update carried no adapter tensor")
        experts = sorted(w for w in pairs if ".experts." in w)
        if experts:  # on every worker alike, before anything is written
            raise LoraMergeError(
                f"adapter of {experts[0]!r} is on a routed expert, which lora.sync=vllm cannot serve (vLLM's fused"
                f" MoE experts take no LoRA): use lora.sync=merge"
            )
        self.merged_weights = len(pairs)
        self.rank = {a.shape[0] for a, _ in pairs.values()}.pop()
        if self.writes:
            folder = self.root / f"v{self.version}"
            if folder.exists():  # a retried version: write it again from scratch
                shutil.rmtree(folder)
            self.rank = write_peft_folder(folder, pairs, self.scale, self.base_path)
            self.path = str(folder)
            kept = sorted(self.root.glob("v*"), key=lambda p: p.stat().st_mtime)[:-KEEP_FOLDERS]
            for old in kept:
                shutil.rmtree(old, ignore_errors=True)
        self.adapters = {}

    def describe(self) -> dict:
        """What the engine needs to serve the update (`adapter_path`: None off the writer) and counts."""
        return {"mode": "vllm", "adapter_path": self.path, "rank": self.rank, "adapted_weights": self.merged_weights}
