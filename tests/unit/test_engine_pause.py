"""The engine's pause/resume around a weight update, with a stand-in for vLLM's AsyncLLM (no vLLM, no Ray):
requests that wait for the resume go on after a good update and fail, naming the engine, after a bad one."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest

from megatron_rl.rollout import engine as engine_module
from megatron_rl.rollout.driver import ask_health
from megatron_rl.rollout.engine import EngineError, EngineSpec, GenerationRequest, VLLMEngine
from megatron_rl.rollout.engine_outputs import has_weight_versions, label_versions, span_versions


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

    async def is_paused(self) -> bool:  # the health probe's round trip through the engine core
        return self.paused

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


def test_an_update_vllm_never_answers_fails_at_its_timeout_and_the_engine_is_taken_for_dead(monkeypatch):
    """vLLM's utility calls have no deadline of their own: an update RPC that never returned held the update
    lock for ever and left the engine reporting itself healthy, so nothing restarted it. Now the update fails
    at its timeout, the paused request fails with it, and health says the engine is stuck (the supervisor's
    probe then restarts it, and the trainer's push waits for that restart)."""
    monkeypatch.setattr(engine_module, "UPDATE_GRACE_S", 0.0)

    async def scenario():
        llm = StandInLLM()  # `release` is never set: the RPC never returns
        llm.check_health = lambda: asyncio.sleep(0)
        engine = _engine(llm)
        update, request = await _request_parked_under_update(engine, llm, timeout_s=0.3)
        with pytest.raises(EngineError, match=r"update to version 1 failed: it did not finish within 0\.3 s"):
            await asyncio.wait_for(update, 5)
        with pytest.raises(EngineError, match=r"weights are inconsistent \(update to version 1 failed"):
            await asyncio.wait_for(request, 2)
        assert not llm.paused and not engine._update_lock.locked()
        health = await engine.health()
        assert health["alive"] is False and not health["consistent"]
        assert health["stuck"] == "vLLM did not answer: update to version 1 failed: it did not finish within 0.3 s"
        actor = types.SimpleNamespace(health=types.SimpleNamespace(remote=engine.health))
        assert (await ask_health(actor, 1.0))[1] == health["stuck"]  # the reason the supervisor restarts it for

    asyncio.run(scenario())


def test_a_failed_update_that_vllm_answered_leaves_the_engine_alive():
    """An update that failed with an error (not a silence) is mended by the trainer's next push: not stuck."""

    async def scenario():
        llm = StandInLLM(update_error=RuntimeError("bucket 3: receive timed out"))
        llm.check_health = lambda: asyncio.sleep(0)
        llm.release.set()
        engine = _engine(llm)
        with pytest.raises(EngineError):
            await engine.update_weights(1, "{}", "keep", timeout_s=5.0)
        health = await engine.health()
        assert health["alive"] is True and health["stuck"] == "" and not health["consistent"]

    asyncio.run(scenario())


def test_a_resume_vllm_never_answers_after_a_failed_update_marks_the_engine_stuck():
    """The failed update's error is the one raised; the resume's silence makes the engine dead to the supervisor
    at once, not one update later."""

    class SilentResume(StandInLLM):
        async def resume_generation(self) -> None:
            await asyncio.Event().wait()

    async def scenario():
        llm = SilentResume(update_error=RuntimeError("bucket 3: receive timed out"))
        llm.check_health = lambda: asyncio.sleep(0)
        llm.release.set()
        engine = _engine(llm)
        engine.spec = dataclasses.replace(engine.spec, rpc_timeout_s=0.2)
        with pytest.raises(EngineError, match=r"update to version 1 failed: RuntimeError: bucket 3"):
            await asyncio.wait_for(engine.update_weights(1, "{}", "keep", timeout_s=5.0), 5)
        health = await engine.health()
        assert (
            not health["alive"] and "resuming after the failed update to version 1 took over 0.2 s" in health["stuck"]
        )
        assert not engine._update_lock.locked() and engine._resumed.is_set()

    asyncio.run(scenario())


def test_a_call_within_the_update_that_vllm_never_answers_is_named_as_such():
    """An inner deadline (here the version label's, `rpc_timeout_s`) is not the update's own timeout."""

    async def scenario():
        llm = StandInLLM()
        llm.check_health = lambda: asyncio.sleep(0)
        llm.release.set()
        engine = _engine(llm)
        engine.spec = dataclasses.replace(engine.spec, rpc_timeout_s=0.2)
        engine._native_versions = True
        llm.update_weight_version = lambda *args, **kwargs: asyncio.Event().wait()
        with pytest.raises(EngineError, match=r"failed: a call to vLLM within it did not answer in time"):
            await asyncio.wait_for(engine.update_weights(1, "{}", "keep", timeout_s=30.0), 5)
        assert (await engine.health())["stuck"].startswith("vLLM did not answer: update to version 1 failed: a call")

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


class LabellingLLM(StandInLLM):
    """AsyncLLM asked for one output per request (FINAL_ONLY) on a vLLM that labels its outputs with the weight
    versions it is given (`update_weight_version`, vLLM 0.32): the final output carries the spans of tokens each
    label sampled. The test moves the tokens sampled so far (`so_far`); the request ends with `total` tokens."""

    def __init__(self, total: int):
        super().__init__()
        self.release.set()
        self.total, self.so_far = total, 0
        self.finish, self.started = asyncio.Event(), asyncio.Event()
        self.labels: list[tuple[str, int]] = []  # (label, tokens sampled before it), as vLLM's spans start
        self.labelled_while_running: list[bool] = []

    async def update_weight_version(self, version: str) -> None:
        self.labelled_while_running.append(not self.paused and self.started.is_set())
        self.labels.append((version, self.so_far))

    async def generate(self, prompt: dict, params, request_id: str):
        self.started.set()
        await self.finish.wait()
        tokens = list(range(10, 10 + self.total))
        starts = [(v, at) for v, at in self.labels if at < self.total]
        ends = [at for _, at in starts[1:]] + [self.total]
        spans = [types.SimpleNamespace(version=v, start=at, end=end) for (v, at), end in zip(starts, ends)]
        completion = types.SimpleNamespace(
            token_ids=tokens, logprobs=[{t: -0.1} for t in tokens], finish_reason="length", weight_versions=spans
        )  # fmt: skip
        yield types.SimpleNamespace(outputs=[completion])


def _labelling_engine(llm: LabellingLLM) -> VLLMEngine:
    engine = _engine(llm)
    engine._native_versions = has_weight_versions(llm)
    return engine


async def _labelled_request_running(total: int, native: bool = True) -> tuple[LabellingLLM, VLLMEngine, asyncio.Task]:
    """An engine on a labelling vLLM, labelled version 0 as `start` does, and a request of `total` tokens it has
    started (`native` False: the engine labels the tokens itself, as with a vLLM without labels)."""
    llm = LabellingLLM(total=total)
    engine = _engine(llm)
    engine._native_versions = native
    await label_versions(llm, 0, 5.0)
    request = asyncio.create_task(engine.generate(GenerationRequest(prompt_ids=[1, 2], max_tokens=total)))
    await llm.started.wait()
    return llm, engine, request


def test_each_token_gets_the_version_vllm_labelled_it_with_set_while_generation_was_paused():
    """Two updates land while a request runs (after 3 and 5 of its 8 tokens): vLLM's spans give each token its
    version, and the engine gave vLLM each label with generation paused."""

    async def scenario():
        llm, engine, request = await _labelled_request_running(8)
        llm.so_far = 3
        await engine.update_weights(1, "{}", "keep", timeout_s=5)
        llm.so_far = 5
        await engine.update_weights(2, "{}", "keep", timeout_s=5)
        llm.finish.set()
        result = await asyncio.wait_for(request, 2)
        assert result.versions == [0, 0, 0, 1, 1, 2, 2, 2] and len(result.token_ids) == 8
        assert llm.labelled_while_running == [False, False, False]  # never while generation could go on

    asyncio.run(scenario())


@pytest.mark.parametrize("native", [True, False], ids=["vllm-labels", "own-labels"])
def test_a_request_that_ran_through_a_failed_update_fails_even_when_a_later_update_mended_the_weights(native):
    """A request frozen ('keep') under an update that fails goes on sampling on the weights it left; a later update
    that succeeds before the request ends makes the engine consistent again, but not those tokens."""

    async def scenario():
        llm, engine, request = await _labelled_request_running(4, native)
        llm.update_error = RuntimeError("bucket 1: receive timed out")
        with pytest.raises(EngineError, match="update to version 1 failed"):
            await engine.update_weights(1, "{}", "keep", timeout_s=5)
        llm.so_far, llm.update_error = 2, None
        await engine.update_weights(1, "{}", "keep", timeout_s=5)
        assert engine.consistent and engine.version == 1
        llm.finish.set()
        with pytest.raises(
            EngineError,
            match=r"engine e0: a request was in flight during a failed weight update \(update to version 1 f",
        ):
            await asyncio.wait_for(request, 2)
        after = await asyncio.wait_for(engine.generate(GenerationRequest(prompt_ids=[1], max_tokens=4)), 2)
        assert len(after.token_ids) == 4  # a request started after the failure is not refused

    asyncio.run(scenario())


class ScoringLLM(StandInLLM):
    """Prompt logprobs (a teacher's scoring) that come back once the test sets `finish`."""

    def __init__(self):
        super().__init__()
        self.release.set()
        self.scoring, self.finish = asyncio.Event(), asyncio.Event()

    async def generate(self, prompt: dict, params, request_id: str):
        self.scoring.set()
        await self.finish.wait()
        rows = [None] + [{t: -0.25} for t in prompt["prompt_token_ids"][1:]]
        yield types.SimpleNamespace(prompt_logprobs=rows, outputs=[])


def test_a_scoring_in_flight_during_a_failed_update_fails_and_names_that_update():
    async def scenario():
        llm = ScoringLLM()
        engine = _engine(llm)
        scoring = asyncio.create_task(engine.score([[1, 2, 3]]))
        await llm.scoring.wait()
        for error in (RuntimeError("bucket 0: receive timed out"), RuntimeError("bucket 2: bad")):
            llm.update_error = error
            with pytest.raises(EngineError):
                await engine.update_weights(1, "{}", "keep", timeout_s=5)
        llm.update_error = None
        await engine.update_weights(1, "{}", "keep", timeout_s=5)
        llm.finish.set()
        with pytest.raises(EngineError, match=r"in flight during a failed weight update \(.*bucket 0: receive timed"):
            await asyncio.wait_for(scoring, 2)  # the first failure it went through is named
        assert await asyncio.wait_for(engine.score([[1, 2, 3]]), 2) == [[-0.25, -0.25]]

    asyncio.run(scenario())


def test_a_label_vllm_refuses_fails_the_update_and_leaves_the_engine_inconsistent():
    async def scenario():
        llm = LabellingLLM(total=1)
        engine = _labelling_engine(llm)

        async def refuse(version: str) -> None:
            raise RuntimeError("engine core is dead")

        llm.update_weight_version = refuse
        with pytest.raises(EngineError, match=r"engine e0: update to version 1 failed: RuntimeError: engine core is"):
            await engine.update_weights(1, "{}", "keep", timeout_s=5)
        assert not engine.consistent and engine.version == 0 and not llm.paused  # resumed: waiting requests fail

    asyncio.run(scenario())


def test_start_labels_the_weights_it_loaded_before_the_engine_takes_requests(monkeypatch):
    """`start` gives vLLM version 0 before anything can generate, and asks an in-process core for no async
    scheduling (whose queued batch a pause would not wait for)."""
    made: dict = {}

    def in_process(args):
        made["args"], made["llm"] = args, LabellingLLM(total=1)
        made["llm"].check_health = lambda: asyncio.sleep(0)
        return made["llm"]

    def engine_args(**fields):  # a dataclass as vLLM's AsyncEngineArgs is (the engine `dataclasses.replace`s it)
        return dataclasses.make_dataclass("Args", list(fields))(**fields)

    stand_in = types.SimpleNamespace(AsyncEngineArgs=engine_args, in_process_async_llm=in_process, token_prompt=list)
    monkeypatch.setattr(engine_module, "_vllm", lambda: stand_in)
    monkeypatch.setattr(engine_module, "prepare_engine_process", lambda spec, on_gpu: None)
    monkeypatch.setattr(engine_module, "_on_gpu", lambda: False)
    engine = VLLMEngine(EngineSpec(name="e0", model_path="unused"))
    health = asyncio.run(engine.start())
    assert made["llm"].labels == [("0", 0)] and engine._native_versions and health["core_in_process"]
    assert made["args"].async_scheduling is False


def test_tokens_vllm_did_not_label_fail_naming_the_engine_and_request():
    async def scenario():
        llm = LabellingLLM(total=4)
        engine = _labelling_engine(llm)
        llm.labels = [("0", 0), ("1", 2), ("default", 3)]  # the last token not labelled with one of ours
        llm.finish.set()
        with pytest.raises(EngineError, match=r"engine e0: vLLM's weight-version spans .* do not label the 4 tokens"):
            await engine.generate(GenerationRequest(prompt_ids=[1, 2], max_tokens=4, request_id="q7"))

    asyncio.run(scenario())


def test_span_versions_expand_vllms_spans_to_one_version_per_token():
    def span(version, start, end):
        return types.SimpleNamespace(version=version, start=start, end=end)

    assert span_versions([span("2", 0, 4)], 4) == [2, 2, 2, 2]
    assert span_versions([span("0", 0, 2), span("1", 2, 5)], 5) == [0, 0, 1, 1, 1]
    assert span_versions(None, 0) == [] and span_versions([], 0) == []
    assert span_versions(None, 3) is None  # tokens without labels
    assert span_versions([span("0", 0, 2)], 3) is None  # spans short of the tokens
    assert span_versions([span("0", 0, 2), span("1", 3, 4)], 4) is None  # a gap
    assert span_versions([span("default", 0, 2)], 2) is None  # vLLM's own label, not a version of ours
    assert has_weight_versions(LabellingLLM(total=1)) and not has_weight_versions(StandInLLM())


def test_one_output_per_request_where_vllm_labels_the_versions():
    """The engine asks for one output per request only where vLLM labels the tokens (else one per token)."""
    vllm = pytest.importorskip("vllm")
    engine = VLLMEngine(EngineSpec(name="e0", model_path="unused"))
    req = GenerationRequest(prompt_ids=[1, 2], max_tokens=8, seed=11)
    assert engine._sampling_params(req, 8).output_kind == vllm.sampling_params.RequestOutputKind.DELTA
    engine._native_versions = True
    assert engine._sampling_params(req, 8).output_kind == vllm.sampling_params.RequestOutputKind.FINAL_ONLY
    from vllm.outputs import CompletionOutput, WeightVersionSpan  # the names the engine reads, in this vLLM

    assert "weight_versions" in {f.name for f in dataclasses.fields(CompletionOutput)}
    assert span_versions([WeightVersionSpan("3", 0, 2)], 2) == [3, 3]
    assert has_weight_versions(vllm.v1.engine.async_llm.AsyncLLM)


def test_a_hung_engine_core_leaves_the_health_probe_unanswered_but_a_running_update_does_not():
    """vLLM's `check_health` only sees whether the engine core's process died: a core that hangs (a stuck kernel or
    collective) passed it while every request waited. The probe now goes through the core; while a worker RPC of
    ours runs there (an update, with its own deadline) it does not queue behind it."""

    async def scenario():
        llm = StandInLLM()
        llm.check_health = lambda: asyncio.sleep(0)
        engine = _engine(llm)
        actor = types.SimpleNamespace(health=types.SimpleNamespace(remote=engine.health))
        healthy = await ask_health(actor, 1.0)
        core_free = asyncio.Event()

        async def hung_core() -> bool:
            await core_free.wait()
            return False

        llm.is_paused = hung_core
        hung = await ask_health(actor, 0.3)
        counters = await asyncio.wait_for(engine.health(), 1.0)  # the meters' and the run's summary's: no round trip
        update, request = await _request_parked_under_update(engine, llm)  # the RPC waits for `release`
        during_update = await ask_health(actor, 0.3)
        llm.release.set()
        core_free.set()
        await asyncio.wait_for(asyncio.gather(update, request), 5)
        return healthy, hung, during_update, counters

    healthy, hung, during_update, counters = asyncio.run(scenario())
    assert counters["alive"] is True
    assert healthy[0]["alive"] is True and healthy[1] is None
    assert hung == ({}, None)  # unanswered: after rollout.hang_timeout_s of these the supervisor restarts it
    assert during_update[0]["alive"] is True and during_update[1] is None
