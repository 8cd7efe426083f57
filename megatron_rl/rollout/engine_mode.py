"""How to start an engine (`EngineSpec`) and how it runs vLLM, decided before vLLM is imported: eager or compiled
(`rollout.enforce_eager`), its engine core in the actor's process or its own (`rollout.engine_core_in_process`), the
attention backend where vLLM's own choice would fail, its token budget per step and the environment vLLM reads."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from megatron_rl.parallel.patches import VLLM_PATCHES_ENV
from megatron_rl.parallel.scheduling import place_process
from megatron_rl.weights.engine.worker import EXTENSION


@dataclasses.dataclass
class EngineSpec:
    """How to start one engine."""

    name: str
    """Engine name (used in every error and metric)."""
    model_path: str
    """HF checkpoint folder the engine starts from."""
    dtype: str = "bfloat16"
    """Serving dtype (vLLM serves fp32 checkpoints in bf16 unless told)."""
    tensor_parallel: int = 1
    """vLLM tensor parallel size."""
    data_parallel: int = 1
    """vLLM data parallel size."""
    expert_parallel: bool = False
    """vLLM expert parallelism over tp x dp."""
    max_model_len: int = 1024
    """Longest prompt + response."""
    gpu_memory_utilization: float = 0.5
    """GPU memory fraction (GPU only)."""
    cpu_kv_cache_gb: int = 1
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    seed: int = 0
    """Sampling seed of the engine."""
    max_num_seqs: int = 64
    """Most sequences scheduled at once."""
    cpu_affinity: list[int] = dataclasses.field(default_factory=list)
    """CPU cores for the engine and its vLLM processes (empty: all)."""
    cpu_batch_scheduling: bool = True
    """On a CPU host, the engine and its vLLM processes under SCHED_BATCH (`rollout.cpu_batch_scheduling`)."""
    worker_extension: str = EXTENSION
    """vLLM worker extension class by qualified name: the production `WeightUpdateExtension`, or a subclass that
    adds RPCs for a test or benchmark (it must be importable in vLLM's worker processes)."""
    capture_routes: bool = False
    """Return each response's routed experts (`GenerationResult.routes`) for routing replay: the workers capture
    every MoE layer's top-k per request (`weights/engine/routes.py`)."""
    native_routes: bool | None = None
    """Take the routes from vLLM's own `enable_return_routed_experts` (`CompletionOutput.routed_experts`; V2 model
    runner, prefix caching on, which the engine then resets at every weight update) instead of our worker-side
    capture (the V1 runner's, vllm-cpu's); None: native on CUDA, captured elsewhere."""
    rpc_timeout_s: float = 60.0
    """Deadline of each route fetch from the workers."""
    max_logprobs: int = 20
    """Most logprobs a request may ask for per token (vLLM's `max_logprobs`, its default 20): at least top_k + 1
    for requests that return their kept sets (`GenerationRequest.return_kept_sets`)."""
    lora_rank: int = 0
    """`lora.sync: vllm`: serve synced adapters (rank up to this) as a vLLM LoRA adapter (`engine_lora.py`); 0: off."""
    enforce_eager: bool | None = None
    """vLLM's eager mode (`rollout.enforce_eager`); None: `eager_mode` decides."""
    engine_core_in_process: bool | None = None
    """vLLM's engine core in this actor's process (`rollout/vllm_inproc.py`) instead of its own; None: in-process
    on CPU with one worker (`rollout.engine_core_in_process`)."""


HALF_DTYPES = ("bfloat16", "float16", "half")
"""The dtypes vllm-cpu's AMX MLA backend runs in."""


def eager_mode(enforce_eager: bool | None, hook_routes: bool, on_gpu: bool) -> bool:
    """Whether vLLM runs eagerly (no torch.compile, no CUDA graphs): `enforce_eager` when set, else eager on CPU
    (vllm-cpu's compiled mode adds 20-30 s to every start: the quickstart and tests start engines often) and where the
    workers capture the routes themselves (`hook_routes`: bound to the routers after start-up, so graphs compiled
    before would not capture); compiled on GPU. ValueError when compiled mode is asked for with that capture."""
    if enforce_eager is False and hook_routes:
        raise ValueError(
            "rollout.enforce_eager=false cannot capture routes in the workers (routing replay without vLLM's native "
            "routes): the capture is bound after start-up, which compiled graphs miss; leave enforce_eager unset or "
            "use native routes"
        )
    if enforce_eager is not None:
        return enforce_eager
    return hook_routes or not on_gpu


def core_in_process(asked: bool | None, workers: int, on_gpu: bool) -> bool:
    """Whether vLLM's engine core runs in the engine actor's process (`rollout/vllm_inproc.py`): `asked`
    (`rollout.engine_core_in_process`) when set, else on CPU with one worker (vLLM starts the workers of tensor or
    data parallel engines from its engine-core process; on GPU that process schedules beside the device's work).
    ValueError when asked for an engine of several workers."""
    if asked and workers > 1:
        raise ValueError(
            f"rollout.engine_core_in_process=true needs engines of one worker, not {workers} (tensor x data "
            "parallel): vLLM starts the other workers from its engine-core process; leave it unset or false"
        )
    if asked is not None:
        return asked
    return not on_gpu and workers == 1


def cpu_attention_backend(model_path: str | Path, dtype: str, on_gpu: bool) -> str | None:
    """The attention backend to ask vLLM for, or None for its own choice: "CPU_MLA" for a multi-head latent
    attention model (DeepSeek-V3's `kv_lora_rank` in its config.json) in a dtype other than bf16/fp16 on CPU.
    vllm-cpu 0.32 prefers its AMX MLA backend on any CPU with AMX tiles, and that backend's weight prepack takes
    only half or int8 weights: an fp32 engine died at start-up ("expect weight to be bfloat16, float16, int8 ...")
    where CPU_MLA, its choice on CPUs without AMX, runs. `dtype` "auto" leaves the choice to vLLM."""
    if on_gpu or str(dtype).removeprefix("torch.") in (*HALF_DTYPES, "auto"):
        return None
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    uses_mla = json.loads(config.read_text()).get("kv_lora_rank") is not None
    return "CPU_MLA" if uses_mla else None


def prepare_engine_process(spec, on_gpu: bool) -> None:
    """Ready this process (an engine actor's) for vLLM before it starts, as the engine of `spec` (an `EngineSpec`)
    asks: the environment vLLM reads at import and start (set where unset), the cores, the scheduling policy; vLLM's
    threads and processes inherit all three."""
    place_process(spec.cpu_affinity, spec.cpu_batch_scheduling and not on_gpu, "rollout.cpu_affinity")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.cpu_kv_cache_gb))
    # vLLM logs to stdout by default; Ray forwards that to the driver's stdout, where reports go.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not on_gpu:
        # vllm-cpu's automatic binding pins a worker to one core (and refuses several workers on one NUMA node);
        # the engine shares its cores with the trainer, and pinned it could not use the core of a waiting rank.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # One worker: let it run where the engine core runs (vllm-cpu would give it a process of its own unless this
        # is 0), which saves a message-queue hop each decode step; the core itself runs in this actor
        # (`rollout/vllm_inproc.py`).
        if spec.tensor_parallel * spec.data_parallel == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ[VLLM_PATCHES_ENV] = "1"  # our vLLM patches, applied by vLLM's plugin loader in each of its processes
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def batched_tokens(spec, on_gpu: bool) -> int | None:
    """vLLM's token budget per scheduler step: its own default on GPU; on CPU enough for every sequence's whole
    prompt at once, so that no prefill is ever chunked. vllm-cpu 0.32 crashes the engine on a chunked prefill of a
    seeded request (the runner rewinds the request's generator with `set_offset`, and "CPU Generator does not use
    offset"); our requests are all seeded."""
    if on_gpu:
        return None
    return max(2048, spec.max_num_seqs * spec.max_model_len)
