"""vLLM worker extension for in-place weight updates.

Pass `worker_extension_cls="megatron_rl.weights.engine.worker.WeightUpdateExtension"` to `vllm.LLM(...)`;
vLLM mixes this class into its worker, and `llm.collective_rpc("<method>", args=(...))` calls a method on
every worker. Tensors cannot travel through `collective_rpc`, so the real transport (a gloo broadcast) calls
`self.mrl_weight_loader().load(...)` / `.finish()` from inside the worker; `mrl_load_file_for_test` reads a
safetensors checkpoint from disk instead and exists for tests only.

Every attribute here is prefixed `mrl_`: vLLM refuses an extension whose attribute names clash with the
worker's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_rl.parallel.patches import applied_vllm_patches
from megatron_rl.weights.engine.loader import InPlaceWeightLoader, checkpoint_shapes
from megatron_rl.weights.engine.receiver import WeightReceiver


class WeightUpdateExtension:
    """Methods added to the vLLM worker (`self` is the worker: it has `model_runner`)."""

    def mrl_weight_loader(self) -> InPlaceWeightLoader:
        """The worker's loader, created on first use for the model the worker runs."""
        loader = getattr(self, "_mrl_loader", None)
        if loader is None:
            model_config = self.model_runner.model_config
            parallel = self.model_runner.vllm_config.parallel_config
            # Under pipeline or expert parallel inference a rank legitimately ignores other ranks' tensors.
            distributed = parallel.pipeline_parallel_size > 1 or getattr(parallel, "enable_expert_parallel", False)
            loader = InPlaceWeightLoader(
                self.model_runner.get_model(),
                act_dtype=model_config.dtype,
                strict=not distributed,
                expected_shapes=_start_checkpoint_shapes(model_config.model),
            )
            self._mrl_loader = loader
        return loader

    def mrl_describe_weight_loader(self) -> dict:
        """Loader mode, counts of prepacked parameters, and the vLLM patches applied in this worker (picklable)."""

        return {**self.mrl_weight_loader().describe(), "vllm_patches": applied_vllm_patches()}

    def mrl_load_file_for_test(self, path: str, names: list[str] | None = None) -> int:
        """TEST ONLY: load the tensors `names` (all if None) of a safetensors file or checkpoint folder."""

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
        """TEST ONLY: load tensors sent as (name, nested list) pairs, e.g. to provoke errors."""

        return self.mrl_weight_loader().load((name, torch.tensor(data)) for name, data in named)

    def mrl_init_weight_groups(self, groups_json: str, rank_offset: int, timeout_s: float) -> dict:
        """Join every trainer sender's weight group as member `rank_offset + this worker's index in the engine`."""
        receiver = getattr(self, "_mrl_receiver", None) or WeightReceiver()
        self._mrl_receiver = receiver
        self.mrl_weight_loader().prepare()  # memory for the updates, before the first one
        return receiver.join(groups_json, rank_offset + self.mrl_worker_index(), timeout_s)

    def mrl_worker_index(self) -> int:
        """This worker's index among all workers of its engine: data-parallel replica, then rank within it.

        vLLM's `self.rank` counts within one data-parallel replica only (vLLM 0.32 multiproc executor), so with
        `data_parallel_size > 1` replicas would otherwise claim the same group ranks.
        """
        parallel = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        replica, per_replica = (parallel.data_parallel_rank, parallel.world_size) if parallel else (0, 1)
        return replica * per_replica + int(getattr(self, "rank", 0))

    def mrl_receive_update(self, version: int, plan_json: str) -> dict:
        """Receive update `version` (every bucket of the plan) over the weight groups and load it in place."""
        receiver = getattr(self, "_mrl_receiver", None)
        if receiver is None:
            raise RuntimeError("mrl_receive_update before mrl_init_weight_groups")
        return receiver.receive(version, plan_json, self.mrl_weight_loader())

    def mrl_receive_raw(self, sender: int, nbytes: int, chunk_bytes: int, in_flight: int = 1) -> dict:
        """Benchmark baseline: receive bytes over the weight group of `sender` without loading them."""
        return self._mrl_receiver.receive_raw(sender, nbytes, chunk_bytes, in_flight)

    def mrl_finish_weight_update(self) -> None:
        """End the current update (see `InPlaceWeightLoader.finish`)."""
        self.mrl_weight_loader().finish()


def _start_checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the checkpoint the engine started from (updates share its layout); None if not local."""
    shapes = checkpoint_shapes(model) if Path(model).is_dir() else {}
    return shapes or None
