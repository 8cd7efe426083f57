"""A worker extension for tests: the production `WeightUpdateExtension` plus RPCs that load tensors from disk or
from lists, without the weight groups (`tests/distributed/test_vllm_loader.py`).

vLLM imports it by name in its worker process (`EXTENSION`), which finds `tests.support` when the repository
root is on sys.path (PYTHONPATH for a subprocess).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_rl.weights.engine.worker import WeightUpdateExtension


class WeightExtensionForTests(WeightUpdateExtension):
    """Adds `mrl_load_file_for_test` and `mrl_load_named_for_test`."""

    def mrl_load_file_for_test(self, path: str, names: list[str] | None = None) -> int:
        """Load the tensors `names` (all if None) of a safetensors file or checkpoint folder as one bucket."""
        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
        wanted = None if names is None else set(names)
        tensors = []
        for file in files:
            for name, tensor in load_file(str(file)).items():
                if wanted is None or name in wanted:
                    tensors.append((name, tensor))
        if wanted is not None and len(tensors) != len(wanted):
            found = {name for name, _ in tensors}
            raise KeyError(f"not in {path}: {sorted(wanted - found)[:10]}")
        return self.mrl_weight_loader().load(tensors)

    def mrl_load_named_for_test(self, named: list[tuple[str, list]]) -> int:
        """Load tensors sent as (name, nested list) pairs, e.g. to provoke errors."""
        return self.mrl_weight_loader().load((name, torch.tensor(data)) for name, data in named)


EXTENSION = f"{WeightExtensionForTests.__module__}.{WeightExtensionForTests.__qualname__}"
"""Its qualified name, for vLLM's `worker_extension_cls`."""
LOAD_FILE = WeightExtensionForTests.mrl_load_file_for_test.__name__
"""RPC: load tensors of a checkpoint (args: path, names or None)."""
LOAD_NAMED = WeightExtensionForTests.mrl_load_named_for_test.__name__
"""RPC: load (name, nested list) pairs (args: the list)."""
