"""The rollout side's sections: engines, the buffer and the weight sync."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, NonNegativeInt, field_validator

from megatron_rl.config.base import Section

_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
"""A DNS host name (RFC 1123 labels)."""


class RolloutConfig(Section):
    """The vLLM engines that generate rollouts."""

    num_engines: int = Field(1, ge=1)
    """Number of engine actors."""
    engine_tp: int = Field(1, ge=1)
    """Tensor parallel size of each engine."""
    engine_dp: int = Field(1, ge=1)
    """Data parallel size inside each engine."""
    engine_ep: bool = False
    """Enable vLLM expert parallelism inside each engine (over tp x dp)."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer computes its logprobs at the same temperature (logits / temperature), so
    the importance ratios between trainer and engines compare the same distribution."""
    top_k: int = Field(-1, ge=-1)
    """Sample from the `top_k` most likely tokens only (after the temperature; ties at the k-th value kept, as
    vLLM does); -1: off. With `algorithm.sampling_mask` the trainer applies the same mask to its logprobs."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the most likely tokens whose probability (after the temperature and top-k)
    exceeds `top_p`; 1: off. The engines' logprobs are those of this renormalised set, which the trainer
    reproduces with `algorithm.sampling_mask` (without it every importance ratio is biased)."""
    samples_per_prompt: int = Field(4, ge=1)
    """Responses per prompt (the group size of group-relative advantages)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_kv_cache_gb: int = Field(1, ge=1)
    """KV cache size of a CPU engine (VLLM_CPU_KVCACHE_SPACE)."""
    max_concurrent_prompts: int = Field(16, ge=1)
    """Prompts in flight per engine."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest one prompt's responses (all its samples) may take on an engine; past it they count as an engine
    failure and the prompt is requeued."""
    cpu_affinity: list[NonNegativeInt] = Field(default_factory=list)
    """CPU cores the engine processes run on (empty: all)."""
    cpu_batch_scheduling: bool = True
    """On a CPU host, run the engines under Linux's SCHED_BATCH policy: their threads' wake-ups do not preempt the
    trainer's compute (`parallel/scheduling.py`). GPU engines keep the default policy."""
    enforce_eager: bool | None = None
    """Run vLLM eagerly (true) or compiled (false: torch.compile, plus CUDA graphs on GPU). Unset: compiled on GPU,
    eager on CPU (compiling adds 20-30 s to each start; a long CPU run gains from false) and wherever the workers
    capture the routes themselves (routing replay without vLLM's native routes: the capture is bound to the
    routers after start-up, which graphs compiled before would miss); false together with that capture is
    refused."""
    engine_core_in_process: bool | None = None
    """Run vLLM's engine core in the engine actor's process (true) or in a process of its own, as vLLM does (false).
    Unset: in-process on CPU engines with one worker (no tensor or data parallel), where the separate process only
    adds message encoding and I/O threads on the trainer's cores; its own process elsewhere. In-process, the
    engine actor answers no call (health checks included) while a generation step or a weight update runs; true
    is refused for engines of several workers."""
    max_engine_restarts: int = Field(3, ge=0)
    """How often each engine that dies is restarted (and brought to the current weights) before the run fails."""
    hang_timeout_s: float = Field(120.0, gt=0)
    """An engine that answers no health probe for this long (alive but silent: stopped, deadlocked) is taken as
    dead: killed, restarted and its prompts requeued, as a dead one is."""
    restart_timeout_s: float = Field(600.0, gt=0)
    """Longest an engine restart may take (vLLM start-up included). The trainer waits as long, after a failed
    weight push, for the restart before the push fails for good."""

    @field_validator("top_k")
    @classmethod
    def _top_k_on_or_off(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (off) or at least 1")
        return value


class BufferConfig(Section):
    """The rollout buffer between engines and trainer."""

    capacity: int = Field(256, ge=1)
    """Most groups buffered plus in flight (each claimed prompt reserves a slot); generation waits when full."""
    max_staleness: int = Field(4, ge=0)
    """Groups whose oldest token is more than this many versions behind the trainer are dropped (or kept, per
    `stale_policy`)."""
    lookahead: Literal["adaptive", "max"] = "adaptive"
    """`mode: async` only: how far generation runs ahead of the trainer. `adaptive`: just far enough that the
    trainer waits for batches at most `target_trainer_idle` of its time (sized from its waits, one step to start
    with), so batches are as fresh as that allows; `max`: always `max_staleness` steps ahead. `max_staleness`
    stays the hard bound either way."""
    target_trainer_idle: float = Field(0.05, gt=0, lt=1)
    """With `lookahead: adaptive`: the largest share of its time the trainer should spend waiting for data. Where
    engines and trainer share CPU cores (the CPU quickstart) a waiting trainer lends its core to the engines, so a
    higher target keeps batches fresher at about the same throughput."""
    max_requeues: int = Field(3, ge=0)
    """How often a prompt whose engine died is generated again before it is dropped."""
    stale_policy: Literal["drop", "correct"] = "drop"
    """What happens to groups beyond `max_staleness`: `drop` them, or `correct`: keep them (counted as stale in
    the metrics) and rely on the token-level importance correction every group gets (`algorithm.correction` with
    the decoupled loss), which a run with this policy must therefore have; no extra correction is applied."""


class SyncConfig(Section):
    """Weight sync from trainer to engines."""

    transport: Literal["auto", "nccl", "gloo"] = "auto"
    """Broadcast backend: NCCL on GPU, gloo on CPU (auto picks)."""
    bucket_mb: int = Field(64, ge=1)
    """Bucket size in MiB: the trainer holds 2 and each engine worker 3. 64 (the quickstart's, `verify sync`'s
    and `bench/weight_sync.py`'s) is what CPU runs were measured at; the GPU configs set 512-1024."""
    timeout_s: float = Field(300.0, gt=0)
    """Deadline of one whole sync; an engine that does not join or dies fails it, named."""
    gloo_streams: int = Field(2, ge=1, le=8)
    """gloo (CPU) only: TCP connections between the sender and each engine worker, taken in turn by
    consecutive broadcasts so that several move at once (one loopback stream is latency-bound: two moved the
    same bytes in about 0.7 of the time). NCCL ignores it."""
    inflight: Literal["pause", "abort"] = "pause"
    """Requests in flight during a sync: paused and resumed, or aborted and continued from their prefix."""
    bind_host: str = "127.0.0.1"
    """Address each sender's rendezvous store binds to and engines connect to: loopback by default; on several
    nodes this node's address, or `auto` (MRL_NODE_IP, else the address of this host's name)."""

    @field_validator("bind_host")
    @classmethod
    def _host_or_auto(cls, value: str) -> str:
        if value == "auto":
            return value
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
        if not _HOST_NAME.fullmatch(value):
            raise ValueError("must be an IP address, a host name (letters, digits, '-', '.') or 'auto'")
        return value
