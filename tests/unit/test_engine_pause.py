"""The engine's pause/resume around a weight update, with a stand-in for vLLM's AsyncLLM (no vLLM, no Ray):
requests that wait for the resume go on after a good update and fail, naming the engine, after a bad one."""

from __future__ import annotations

import asyncio
import collections
import types

import pytest

from megatron_rl.rollout import engine as engine_module
from megatron_rl.rollout.engine import EngineError, EngineSpec, GenerationRequest, VLLMEngine
from megatron_rl.rollout.engine_outputs import output_counter, token_versions


class StandInLLM:
    """What `VLLMEngine` uses of AsyncLLM: one-token generation, pause/resume, and a weight-update RPC that waits
    for `release`, then fails with `update_error` (if set)."""

    def __init__(self, update_error: BaseException | None = None, resume_error: BaseException | None = None):
        self.update_error = update_error
        self.resume_error = resume_error
        self.update_started = asyncio.Event()
        self.release = asyncio.Event()
        self.paused = False

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        if self.resume_error is not None:
            raise self.resume_error
        self.paused = False

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list:
        self.update_started.set()
        await self.release.wait()
        if self.update_error is not None:
            raise self.update_error
        return [{"worker": 0}]

    async def generate(self, prompt: dict, params, request_id: str):
        completion = types.SimpleNamespace(token_ids=[7], logprobs=[{7: -0.5}], finish_reason="stop")
        yield types.SimpleNamespace(outputs=[completion])


def _engine(llm: StandInLLM) -> VLLMEngine:
    engine = VLLMEngine(EngineSpec(name="e0", model_path="unused"))
    engine._llm = llm
    engine._sampling_params = lambda *args: None  # vLLM's SamplingParams: unused by the stand-in
    return engine


async def _request_parked_under_update(engine: VLLMEngine, llm: StandInLLM, timeout_s: float = 5.0):
    """Start an update and, while it has generation paused, a request; returns (update task, request task)."""
    update = asyncio.create_task(engine.update_weights(1, "{}", "keep", timeout_s=timeout_s))
    await llm.update_started.wait()
    request = asyncio.create_task(engine.generate(GenerationRequest(prompt_ids=[1, 2], max_tokens=4)))
    await asyncio.sleep(0.05)
    assert not request.done(), "the request should wait while the update has generation paused"
    return update, request


@pytest.mark.parametrize("resume_error", [None, RuntimeError("vLLM engine core is dead")])
def test_a_failed_update_releases_the_waiting_requests_with_the_engines_error(resume_error):
    async def scenario():
        llm = StandInLLM(update_error=RuntimeError("bucket 3: receive timed out"), resume_error=resume_error)
        engine = _engine(llm)
        update, request = await _request_parked_under_update(engine, llm)
        llm.release.set()
        with pytest.raises(EngineError, match=r"engine e0: update to version 1 failed: RuntimeError: bucket 3"):
            await update
        with pytest.raises(EngineError, match=r"engine e0: weights are inconsistent \(update to version 1 failed"):
            await asyncio.wait_for(request, 2)  # it used to wait for the resume for ever
        assert not engine.consistent and engine.version == 0

    asyncio.run(scenario())


def test_a_good_update_lets_the_waiting_requests_go_on_at_the_new_version():
    async def scenario():
        llm = StandInLLM()
        engine = _engine(llm)
        update, request = await _request_parked_under_update(engine, llm)
        llm.release.set()
        assert (await update)["version"] == 1
        result = await asyncio.wait_for(request, 2)
        assert (result.token_ids, result.versions, result.logprobs) == ([7], [1], [-0.5])
        assert not llm.paused

    asyncio.run(scenario())


def test_generation_paused_past_the_updates_timeout_fails_naming_the_engine(monkeypatch):
    monkeypatch.setattr(engine_module, "RESUME_WAIT_MARGIN_S", 0.0)

    async def scenario():
        llm = StandInLLM()
        engine = _engine(llm)
        update, request = await _request_parked_under_update(engine, llm, timeout_s=0.2)
        with pytest.raises(EngineError, match=r"engine e0: generation still paused after 0\.2 s"):
            await asyncio.wait_for(request, 2)
        llm.release.set()
        await update

    asyncio.run(scenario())


class NativeRoutesLLM(StandInLLM):
    """A GPU engine's AsyncLLM with vLLM's own routed-experts output: each finished segment carries its rows
    (positions 0 .. end - 2 of its prompt + tokens), and a prefix cache that a frozen request blocks."""

    def __init__(self, routes: bool = True, plain_reset_works: bool = True):
        super().__init__()
        self.release.set()
        self.routes, self.plain_reset_works = routes, plain_reset_works
        self.resets: list[bool] = []

    async def generate(self, prompt: dict, params, request_id: str):
        import numpy as np

        n = len(prompt["prompt_token_ids"])  # one new token: rows for the n positions fed, int32 as vLLM's
        rows = (np.arange(n)[:, None, None] + np.zeros((1, 2, 2), dtype=np.int32)) % 8 if self.routes else None
        completion = types.SimpleNamespace(
            token_ids=[7], logprobs=[{7: -0.5}], finish_reason="stop", routed_experts=rows
        )  # fmt: skip
        yield types.SimpleNamespace(outputs=[completion])

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets.append(reset_running_requests)
        return reset_running_requests or self.plain_reset_works


def _native_engine(llm: NativeRoutesLLM) -> VLLMEngine:
    engine = VLLMEngine(EngineSpec(name="e0", model_path="unused", capture_routes=True, native_routes=True))
    engine._llm = llm
    engine._sampling_params = lambda *args: None
    return engine


def test_native_routes_come_from_vllms_output_and_every_update_resets_the_prefix_cache():
    """GPU path: the routes are vLLM's `routed_experts` in the compact dtype (no worker capture RPCs), and each
    weight update resets the prefix cache, preempting frozen requests when a plain reset cannot."""
    from megatron_rl.models.routes import decode_routes

    async def scenario():
        llm = NativeRoutesLLM()
        engine = _native_engine(llm)
        result = await engine.generate(GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=1))
        routes = decode_routes(result.routes)
        assert routes.dtype.name == "uint8" and routes.shape == (3, 2, 2)  # P + T - 1 positions
        assert routes[:, 0, 0].tolist() == [0, 1, 2]
        await engine.update_weights(1, "{}", "keep", timeout_s=5)
        assert llm.resets == [False]
        llm.plain_reset_works = False  # a request frozen by 'keep' holds cache blocks
        await engine.update_weights(2, "{}", "keep", timeout_s=5)
        assert llm.resets == [False, False, True] and engine.version == 2

    asyncio.run(scenario())


def test_a_segment_without_native_routes_fails_naming_the_engine():
    async def scenario():
        engine = _native_engine(NativeRoutesLLM(routes=False))
        with pytest.raises(EngineError, match=r"engine e0: vLLM returned no routed experts for \['.*-0'\]"):
            await engine.generate(GenerationRequest(prompt_ids=[1, 2], max_tokens=1))

    asyncio.run(scenario())


def test_requests_reach_vllm_rendered_with_their_own_sampling_params():
    """vLLM deep-copies a request's SamplingParams unless told it is the request's own: ours are made per request
    (a continuation makes new ones), so vLLM's clone of them must be shallow and carry the request's seed. The
    prompt is vLLM's rendered token input (typed), which it takes without its renderer's pass."""
    pytest.importorskip("vllm")
    assert engine_module._vllm().token_prompt([5, 6]) == {"type": "token", "prompt_token_ids": [5, 6]}
    engine = VLLMEngine(EngineSpec(name="e0", model_path="unused"))
    req = GenerationRequest(prompt_ids=[1, 2], max_tokens=8, stop_token_ids=[2], seed=11)
    first, again = engine._sampling_params(req, 8), engine._sampling_params(req, 5, continuation=1)
    assert first is not again and first.stop_token_ids is not again.stop_token_ids
    clone = first.clone()
    assert clone is not first and clone.stop_token_ids is first.stop_token_ids  # shallow: no deep copy
    assert (clone.seed, again.seed, again.max_tokens) == (11, 11 + 7919, 5)


class FinalOnlyLLM(StandInLLM):
    """AsyncLLM asked for one output per request (FINAL_ONLY): its front end counts each running request's tokens
    (`output_processor`, as vLLM 0.32 keeps them); the request ends when `finish` is set, with `total` tokens."""

    def __init__(self, total: int):
        super().__init__()
        self.release.set()
        self.total, self.so_far, self.finish = total, 0, asyncio.Event()
        self.started = asyncio.Event()
        detokenizer = types.SimpleNamespace(num_output_tokens=lambda: self.so_far)
        self.output_processor = types.SimpleNamespace(
            request_states={"internal-0": types.SimpleNamespace(detokenizer=detokenizer)},
            external_req_ids=collections.defaultdict(list),
        )

    async def generate(self, prompt: dict, params, request_id: str):
        self.output_processor.external_req_ids[request_id].append("internal-0")
        self.started.set()
        await self.finish.wait()
        tokens = list(range(10, 10 + self.total))
        completion = types.SimpleNamespace(
            token_ids=tokens, logprobs=[{t: -0.1} for t in tokens], finish_reason="length"
        )
        yield types.SimpleNamespace(outputs=[completion])


def test_one_output_per_request_labels_each_token_with_the_update_it_came_after():
    """With one output at the end, the tokens before each update's count (3, then 5) keep the old version."""

    async def scenario():
        llm = FinalOnlyLLM(total=8)
        engine = _engine(llm)
        engine._count_tokens = output_counter(llm)
        request = asyncio.create_task(engine.generate(GenerationRequest(prompt_ids=[1, 2], max_tokens=8)))
        await llm.started.wait()
        llm.so_far = 3
        await engine.update_weights(1, "{}", "keep", timeout_s=5)
        llm.so_far = 5
        await engine.update_weights(2, "{}", "keep", timeout_s=5)
        llm.finish.set()
        result = await asyncio.wait_for(request, 2)
        assert result.versions == [0, 0, 0, 1, 1, 2, 2, 2] and len(result.token_ids) == 8
        assert engine._boundaries == {}  # nothing left behind for the finished request

    asyncio.run(scenario())


def test_token_versions_split_a_response_at_each_boundary():
    assert token_versions(4, 2, []) == [2, 2, 2, 2]
    assert token_versions(5, 0, [(2, 1)]) == [0, 0, 1, 1, 1]
    assert token_versions(3, 0, [(0, 1), (3, 2)]) == [1, 1, 1]  # sent before the first, finished before the second
    assert token_versions(6, 4, [(1, 5), (1, 6), (4, 7)]) == [4, 6, 6, 6, 7, 7]  # two updates with no token between
    assert token_versions(2, 0, [(9, 1)]) == [0, 0]  # a count past the end (as reported) moves nothing


def test_output_counter_reads_vllms_request_states_and_refuses_other_layouts():
    counter = output_counter(FinalOnlyLLM(total=1))
    assert counter is not None and counter("never-sent") is None
    assert output_counter(types.SimpleNamespace()) is None  # a vLLM without that front end: one output per token
    llm = FinalOnlyLLM(total=1)
    llm.so_far = 4
    llm.output_processor.external_req_ids["r-0"].append("internal-0")
    assert output_counter(llm)("r-0") == 4
    del llm.output_processor.request_states["internal-0"]  # finished: its output is on its way
    assert output_counter(llm)("r-0") is None
