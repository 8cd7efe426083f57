"""vLLM's AsyncLLM with its engine core in the engine actor's own process (CPU engines with one worker).

`AsyncLLM` always runs its engine core in a process of its own and talks to it over ZMQ: every decode step's
outputs are msgpack-encoded there and decoded here, and two I/O threads in each process move them. On a GPU that
process keeps scheduling beside the device's work; on a CPU engine it only adds CPU time on the cores the trainer
needs (docs/benchmarks.md, "The engine core in the actor's process"). `AsyncInprocClient` gives AsyncLLM the async client
interface over vLLM's own in-process `EngineCore` instead: the output handler's `get_output_async` runs one engine
step in the event loop, so requests, aborts, pauses and RPCs land between steps, as they do between the busy
loop's steps in vLLM's engine-core process. Everything above the client (request streams, output processing,
abort, pause and resume, `collective_rpc`, LoRA) is vLLM's AsyncLLM unchanged.

Imported by the engine actor only (`rollout/engine.py`): this module imports vLLM.
"""

from __future__ import annotations

import asyncio
import collections

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import InprocClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.request import RequestStatus

try:  # vLLM takes its rendered token input in the event loop, without a renderer pass in a worker thread
    from vllm.inputs.engine import tokens_input
except ImportError:  # a vLLM from before rendered inputs: the engine hands it raw prompts
    tokens_input = None

from megatron_rl.parallel.patches import async_llm_client
from megatron_rl.rollout.burst import until_quiet

IDLE_STEP_PAUSE_S = 0.001
"""Sleep after a step that ran no model while requests remain (vLLM's busy loop sleeps as long there)."""


class _Resources:
    """The part of MPClient's `BackgroundResources` AsyncLLM reads: whether the engine died."""

    engine_dead = False


class AsyncInprocClient(InprocClient):
    """AsyncLLM's engine-core client over an `EngineCore` in this process, stepped by AsyncLLM's output handler.

    The methods AsyncLLM awaits run the in-process core's call directly (they take microseconds, or as long as the
    worker RPC runs); `get_output_async` steps the core whenever it holds requests and waits for an add or a
    resume otherwise. While a step or an RPC (a weight update) runs, the actor answers no other call: a CPU
    engine's update takes a fraction of a second, far under the supervisor's `rollout.hang_timeout_s`."""

    def __init__(self, vllm_config, executor_class, log_stats: bool, **_mp_only):
        super().__init__(vllm_config, executor_class, log_stats)
        self.resources = _Resources()
        self.engine_ranks_managed = [0]
        self._work = asyncio.Event()  # an add or a resume may have given the core something to step
        self._ready: collections.deque[EngineCoreOutputs] = collections.deque()  # abort outputs of a pause
        self.added = 0
        """Requests added so far."""

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs for AsyncLLM's output handler (abort outputs of a pause first)."""
        while True:
            await asyncio.sleep(0)  # let the adds, aborts and pauses that wait on the loop land before this step
            if self._ready:
                return self._ready.popleft()
            if not self.engine_core.scheduler.has_requests():  # nothing to run, or all of it paused
                self._work.clear()
                await self._work.wait()
                # A burst's requests come from calls woken a few iterations apart: start with all of them.
                await until_quiet(lambda: self.added)
                continue
            try:
                outputs, executed = self.engine_core.step_fn()
                self.engine_core.post_step(model_executed=executed)
            except Exception as err:  # as a dead engine-core process: every request stream gets the error
                self.resources.engine_dead = True
                raise EngineDeadError(f"in-process engine core failed: {type(err).__name__}: {err}") from err
            out = outputs.get(0) if outputs else None
            if out is not None:
                return out
            if not executed:
                await asyncio.sleep(IDLE_STEP_PAUSE_S)

    async def add_request_async(self, request) -> None:
        """Queue a request in the core (AsyncLLM's `generate` calls it)."""
        self._require_alive()
        self.add_request(request)
        self.added += 1
        self._work.set()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Drop requests from the core (AsyncLLM already ended their streams)."""
        if request_ids and not self.resources.engine_dead:
            self.abort_requests(request_ids)

    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause: 'keep' freezes the running requests, 'abort' ends them (their streams end with
        finish_reason 'abort', as the engine-core process sends them), 'wait' lets them finish first."""
        core = self.engine_core
        if mode == "wait":  # the in-process core refuses it: queue new requests, step until the running ones end
            core.scheduler.set_pause_state(PauseState.PAUSED_NEW)
            while core.scheduler.has_requests() and not self.resources.engine_dead:
                self._work.set()
                await asyncio.sleep(IDLE_STEP_PAUSE_S)
            if core.scheduler.pause_state != PauseState.PAUSED_NEW:  # resumed while draining: stay resumed
                return
            mode = "keep"  # nothing runs any more; this sets the pause and resets the caches as asked
        elif mode == "abort":  # the in-process core ends them but sends no outputs: their streams would hang
            ids = [r.request_id for r in core.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)]
            if ids:
                outputs = [EngineCoreOutput(i, [], finish_reason=FinishReason.ABORT) for i in ids]
                self._ready.append(EngineCoreOutputs(finished_requests=set(ids), outputs=outputs))
                self._work.set()
        core.pause_scheduler(mode, clear_cache)

    async def resume_scheduler_async(self) -> None:
        """Let the scheduler run the frozen and queued requests again."""
        self.engine_core.resume_scheduler()
        self._work.set()

    async def is_scheduler_paused_async(self) -> bool:
        """Whether the scheduler is paused."""
        return self.engine_core.is_scheduler_paused()

    async def collective_rpc_async(self, method, timeout=None, args=(), kwargs=None) -> list:
        """Call a worker method in this process (it blocks the loop while it runs, as an engine step does)."""
        self._require_alive()
        return self.collective_rpc(method, timeout, args, kwargs)

    def _require_alive(self) -> None:
        if self.resources.engine_dead:
            raise EngineDeadError("in-process engine core failed earlier")

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the core and its worker; later calls see a dead engine."""
        self.resources.engine_dead = True
        super().shutdown(timeout)


RUN_AT_ONCE = (
    "get_supported_tasks", "reset_mm_cache", "reset_prefix_cache", "reset_encoder_cache", "execute_dummy_batch",
    "set_weight_version", "get_weight_version", "add_lora", "remove_lora", "list_loras", "pin_lora",
    "save_sharded_state", "profile",
)  # fmt: skip
"""The other calls AsyncLLM awaits (`<name>_async`): the in-process core's own method, run at once. Sleep and
wake-up are left out (vLLM's base client refuses them): the in-process core's abort sleep sends no outputs, so
the streams it ends would wait for ever; the engine does not use them."""


def _run_at_once(name: str):
    async def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{name}_async"
    call.__doc__ = f"`{name}` of the in-process core, run at once."
    return call


for _name in RUN_AT_ONCE:
    setattr(AsyncInprocClient, f"{_name}_async", _run_at_once(_name))


def in_process_async_llm(engine_args) -> AsyncLLM:
    """`AsyncLLM.from_engine_args(engine_args)` with its engine core in this process (`AsyncInprocClient`)."""
    with async_llm_client(AsyncInprocClient):
        return AsyncLLM.from_engine_args(engine_args)
