"""The generation driver: the reward-failure guard, the engine down/back bookkeeping, and the driver running
against the real buffer (in this process, no Ray) with stand-in engines: the staleness gate, requeues, timeouts,
a reward that exits on every call, and scoring for evaluation."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import sys
import time
import types
from pathlib import Path

import pytest
import ray

from megatron_rl.config import TaskConfig, load_config
from megatron_rl.config.loader import ConfigError
from megatron_rl.rollout import driver as driver_module
from megatron_rl.rollout.buffer import RolloutBuffer
from megatron_rl.rollout.burst import generate_groups
from megatron_rl.rollout.driver import GenerationDriver, GenerationError, RewardError, error_line
from megatron_rl.rollout.engine import EngineError, GenerationRequest, GenerationResult
from megatron_rl.rollout.tasks import PromptStream, Task, make_task
from megatron_rl.rollout.types import Group, Sample
from tests.unit.test_buffer import run_to_a_save

TRL = str(Path(__file__).resolve().parents[1] / "fixtures" / "trl_math.jsonl")


def _group(index: int, failed: bool) -> Group:
    sample = Sample(prompt_ids=[1], response_ids=[2], logprobs=[-0.5], versions=[0], prompt_index=index)
    if failed:
        sample.metadata["reward_error"] = f"reward 'my.fn' raised ZeroDivisionError at {index}"
    return Group(index, [sample])


def _driver(limit: int) -> GenerationDriver:
    cfg = load_config("configs/quickstart.yaml", [f"task.max_bad_reward_groups_in_a_row={limit}"])
    return GenerationDriver(buffer=None, engines={"engine-0": None}, task=None, tokenizer=None, cfg=cfg, lag=1)


def test_the_reward_workers_are_as_many_as_the_config_says():
    assert _driver(limit=3)._rewards._threads.count == 2  # the default
    cfg = load_config("configs/quickstart.yaml", ["task.reward_workers=5"])
    runner = GenerationDriver(buffer=None, engines={}, task=None, tokenizer=None, cfg=cfg, lag=1)._rewards
    assert runner._threads.count == runner._processes.count == 5
    with pytest.raises(ConfigError, match="reward_workers"):
        load_config("configs/quickstart.yaml", ["task.reward_workers=0"])


def test_isolated_reward_failures_are_counted_and_the_run_goes_on():
    driver = _driver(limit=3)
    for index, failed in enumerate([True, True, False, True, True, False]):
        driver._check_rewards(_group(index, failed))
    assert driver.stats.bad_reward_groups == 4


def test_a_reward_that_always_fails_stops_the_run_with_its_error():
    driver = _driver(limit=3)
    driver._check_rewards(_group(0, True))
    driver._check_rewards(_group(1, True))
    with pytest.raises(RewardError, match=r"3 groups in a row.*prompt 2: reward 'my.fn' raised ZeroDivisionError"):
        driver._check_rewards(_group(2, True))


def test_a_dead_engine_gets_no_prompts_until_it_is_brought_back():
    driver = _driver(limit=3)
    driver.mark_down("engine-0", "ActorDiedError")
    driver.mark_down("engine-0", "a later report does not overwrite the first")
    assert driver.down == {"engine-0": "ActorDiedError"}
    replacement = object()
    driver.bring_back("engine-0", replacement)
    assert driver.down == {} and driver.engines["engine-0"] is replacement
    assert driver.stats.engine_restarts == 1


# ---------------------------------------------------------------------------------------------------------------
# The driver running against the real buffer (in this process) and a stand-in engine.


class LocalActor:
    """A plain object behind Ray's call syntax: `actor.method.remote(*args)` runs the method in a thread and is
    awaited like an ObjectRef."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name: str):
        method = getattr(self._obj, name)
        return types.SimpleNamespace(remote=lambda *args: asyncio.to_thread(method, *args))


class CountingTask(Task):
    """Prompt i has answer i; the reward is 1, or fails (NaN) for the answers in `bad`."""

    name = "counting"

    def __init__(self, bad: set[int] = frozenset()):
        super().__init__()
        self.bad = bad

    def prompts(self, epoch=0, start=0):
        index = start
        while True:
            yield {"prompt": f"p{index}", "prompt_ids": [3, index], "answer": index}
            index += 1

    def reward(self, response, answer, sample=None):
        if answer in self.bad:
            raise ValueError(f"no reward for {answer}")
        return 1.0


class StandInEngine:
    """Answers every request with one token at version 0; raises `errors[prompt]` (once per entry) instead."""

    def __init__(self, errors: dict[int, list[BaseException]] | None = None):
        self.errors = errors or {}
        self.burst_calls: list[list[int]] = []  # the prompts of each engine call

    async def _generate(self, req: GenerationRequest) -> GenerationResult:
        pending = self.errors.get(req.prompt_ids[1])
        if pending:
            raise pending.pop(0)
        return GenerationResult(req.request_id, req.prompt_ids, [5], [-0.1], [0], "length", "e0")

    async def _generate_groups(self, groups, timeout_s):
        self.burst_calls.append([reqs[0].prompt_ids[1] for reqs in groups])
        return await generate_groups(groups, self._generate, timeout_s)  # as VLLMEngine.generate_groups

    @property
    def generate_groups(self):
        return types.SimpleNamespace(remote=self._generate_groups)

    async def _health(self, through_core: bool = False) -> dict:
        return {"alive": True, "consistent": True}

    @property
    def health(self):
        return types.SimpleNamespace(remote=self._health)


class StandInTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "x"


def _running_driver(
    buffer: RolloutBuffer, task: Task, engine: StandInEngine, lag: int, *overrides: str
) -> GenerationDriver:
    cfg = load_config(
        "configs/quickstart.yaml",
        ["prompts_per_step=2", "rollout.samples_per_prompt=1", "rollout.max_concurrent_prompts=2", *overrides],
    )
    return GenerationDriver(LocalActor(buffer), {"e0": engine}, task, StandInTokenizer(), cfg, lag=lag)


async def _drive_until(driver: GenerationDriver, condition, timeout_s: float = 10.0) -> None:
    """Run the driver until `condition()` holds (or the timeout), then stop it."""
    run = asyncio.create_task(driver.run())
    deadline = time.monotonic() + timeout_s
    try:
        while not condition() and time.monotonic() < deadline and not run.done():
            await asyncio.sleep(0.02)
    finally:
        driver.stop()
        await asyncio.wait_for(run, 10)


def test_sync_mode_replaces_a_dropped_group_so_the_step_still_fills():
    # lag 0, 2 prompts per step, prompt 0's reward fails: the buffer drops its group. The gate used to count
    # claims, so it refused a third prompt and the trainer waited for a batch that could never fill.
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask(bad={0})))
    driver = _running_driver(buffer, CountingTask(bad={0}), StandInEngine(), lag=0)
    batches = []

    async def scenario():
        batches.append(await asyncio.to_thread(buffer.get_batch, 2, 0, 5.0))
        assert batches[0], f"no batch for step 1 (generation stalled): {buffer.check_accounting()}"
        await asyncio.sleep(0.3)  # on-policy: nothing more is claimed while the trainer is at version 0
        counts = buffer.check_accounting()
        assert (counts["in_flight"], counts["buffered"], counts["produced"]) == (0, 0, 3)
        buffer.set_trainer_version(1)
        batches.append(await asyncio.to_thread(buffer.get_batch, 2, 1, 5.0))

    async def main():
        trainer = asyncio.create_task(scenario())
        await _drive_until(driver, trainer.done)
        await trainer

    asyncio.run(main())
    # (in the order the groups came back: the trainer sorts a batch by prompt index)
    assert [sorted(g.prompt_index for g in batch) for batch in batches] == [[1, 2], [3, 4]]
    assert buffer.stats()["dropped_by_reason"] == {"bad_reward": 1}
    assert driver.stats.dropped_by_buffer == 1 and driver.stats.groups == 4


def test_a_failed_generate_keeps_its_message_and_counts_only_real_requeues(caplog):
    error = ValueError("prompt too long for the engine\nsecond line")
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()), max_requeues=1)
    driver = _running_driver(buffer, CountingTask(), StandInEngine({0: [error, error]}), lag=0)

    def done() -> bool:
        return buffer.stats()["buffered"] == 2

    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.driver"):
        asyncio.run(_drive_until(driver, done))
    stats = buffer.stats()
    assert stats["dropped_by_reason"] == {"requeue_limit": 1}
    assert stats["recent_drops"][0]["detail"].endswith("last: e0: ValueError: prompt too long for the engine")
    assert driver.stats.engine_failures == 2 and driver.stats.requeued == 1  # the second one was a drop
    assert "ValueError: prompt too long for the engine" in caplog.text and "second line" not in caplog.text


def test_error_line_is_the_type_and_the_first_line_of_the_message():
    assert error_line(ValueError("first\nsecond")) == "ValueError: first"
    assert error_line(RuntimeError("")) == "RuntimeError"  # the old code failed here (IndexError)
    assert error_line(ValueError("x" * 300), limit=5) == "ValueError: xxxxx"
    # Raised in an actor: Ray's first line names only the call and the process (`starting vLLM failed for 1
    # engine(s): engine-0: RayTaskError(ValueError): ray::VLLMEngine.start() (pid=5753, ...)`); the cause says why.
    remote = ray.exceptions.RayTaskError("VLLMEngine.start", "Traceback ...", ValueError("no such model\nmore"))
    assert error_line(remote.as_instanceof_cause()) == "ValueError: no such model"


class SilentBuffer:
    """A buffer actor that never answers."""

    def __getattr__(self, name: str):
        return types.SimpleNamespace(remote=lambda *args: asyncio.sleep(3600))


def test_a_buffer_that_does_not_answer_stops_the_driver_naming_the_call(monkeypatch):
    monkeypatch.setattr(driver_module, "CALL_TIMEOUT_S", 0.1)
    driver = _running_driver(None, CountingTask(), StandInEngine(), lag=0)
    driver.buffer = SilentBuffer()
    with pytest.raises(GenerationError, match=r"buffer\.claim_gated did not answer within 0\.1 s"):
        asyncio.run(asyncio.wait_for(driver.run(), 10))


class RefusingEngine(StandInEngine):
    """Refuses every request, as an engine whose weights a failed update left inconsistent does, until its health
    has been asked `repaired_after` times (standing in for the trainer's next push, which repairs it)."""

    def __init__(self, repaired_after: int):
        super().__init__()
        self.health_calls = 0
        self.repaired_after = repaired_after

    async def _generate(self, req: GenerationRequest) -> GenerationResult:
        if self.health_calls <= self.repaired_after:
            raise EngineError("engine e0: weights are inconsistent (update 2 failed); refusing to generate")
        return await super()._generate(req)

    async def _health(self, through_core: bool = False) -> dict:
        self.health_calls += 1
        return {"alive": True, "consistent": self.health_calls > self.repaired_after}


def test_an_engine_refusing_requests_is_waited_for_without_burning_prompts(monkeypatch):
    monkeypatch.setattr(driver_module, "GATE_POLL_S", 0.005)
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()), max_requeues=2)
    engine = RefusingEngine(repaired_after=5)
    driver = _running_driver(buffer, CountingTask(), engine, lag=0)
    asyncio.run(_drive_until(driver, lambda: buffer.stats()["buffered"] == 2))
    stats = buffer.stats()
    # Each of the two workers had one prompt refused and requeued (both may be the same prompt), then waited for
    # the engine instead of claiming prompts for it to refuse: a third refusal would have dropped a prompt.
    assert stats["buffered"] == 2 and stats["dropped_by_reason"] == {}
    assert driver.stats.engine_failures == 2 and driver.stats.requeued == 2
    assert engine.health_calls > engine.repaired_after and driver.down == {}


class SlowEngine(StandInEngine):
    """Never answers prompt 0 in time; answers the others at once."""

    async def _generate(self, req: GenerationRequest) -> GenerationResult:
        if req.prompt_ids[1] == 0:
            await asyncio.sleep(30)
        return await super()._generate(req)


def test_a_request_past_its_timeout_is_an_engine_failure_and_its_prompt_goes_back():
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()), max_requeues=1)
    driver = _running_driver(buffer, CountingTask(), SlowEngine(), lag=1)
    driver.cfg.rollout.request_timeout_s = 0.2
    asyncio.run(_drive_until(driver, lambda: buffer.stats()["dropped"] == 1))
    stats = buffer.stats()
    assert stats["dropped_by_reason"] == {"requeue_limit": 1}  # prompt 0, twice too slow
    assert "not generated within rollout.request_timeout_s=0.2 s" in stats["recent_drops"][0]["detail"]
    assert driver.stats.engine_failures == 2


class HangingRewardTask(CountingTask):
    def reward(self, response, answer, sample=None):
        if answer == 0:
            time.sleep(2)
        return 1.0


def test_a_reward_past_its_timeout_is_a_failed_reward():
    task = HangingRewardTask()
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(task))
    driver = _running_driver(buffer, task, StandInEngine(), 0, "task.reward_timeout_s=0.2")
    asyncio.run(_drive_until(driver, lambda: buffer.stats()["dropped"] == 1))
    assert buffer.stats()["dropped_by_reason"] == {"bad_reward": 1}
    assert task.reward_failures == 1
    assert "timed out after task.reward_timeout_s=0.2 s" in task.report()["recent"][0]["error"]


class DeadInsideEngine(StandInEngine):
    """Its actor answers, but vLLM inside it is dead: every request fails, health says so."""

    async def _generate(self, req: GenerationRequest) -> GenerationResult:
        raise RuntimeError("EngineDeadError: EngineCore encountered an issue")

    async def _health(self, through_core: bool = False) -> dict:
        return {"alive": False, "consistent": True}


def test_an_engine_whose_vllm_died_is_marked_down_at_its_first_failure():
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()), max_requeues=2)
    driver = _running_driver(buffer, CountingTask(), DeadInsideEngine(), lag=1)
    asyncio.run(_drive_until(driver, lambda: "e0" in driver.down))
    time.sleep(0.2)
    # Each of the two workers had a prompt fail once (both may be the same prompt), then the engine was down:
    # nothing was claimed again to fail (a third failure of a prompt would have dropped it).
    assert driver.down == {"e0": "vLLM inside the actor is dead"}
    assert buffer.stats()["dropped_by_reason"] == {}
    assert driver.stats.engine_failures <= 2


def test_workers_waiting_at_the_gate_claim_nothing_for_an_engine_that_went_down():
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    driver = _running_driver(buffer, CountingTask(), StandInEngine(), lag=0)

    async def scenario():
        run = asyncio.create_task(driver.run())
        try:
            await _until(lambda: buffer.stats()["buffered"] == 2)  # step 0's prompts; the gate is closed now
            driver.mark_down("e0", "ActorDiedError: killed during a weight push")
            buffer.set_trainer_version(1)  # the gate opens while the engine is down
            await asyncio.sleep(0.5)
            claimed_while_down = driver.stats.claimed
            driver.bring_back("e0", driver.engines["e0"])
            await _until(lambda: buffer.stats()["buffered"] == 4)
            return claimed_while_down
        finally:
            driver.stop()
            await asyncio.wait_for(run, 10)

    assert asyncio.run(scenario()) == 2  # nothing was claimed for the dead engine (it would have failed on it)
    assert driver.stats.engine_failures == 0 and buffer.stats()["dropped"] == 0


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def exiting_reward(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(3)


def test_a_reward_that_always_exits_stops_the_run_naming_the_reward_and_the_row():
    from megatron_rl.models.tiny import build_tokenizer

    cfg = TaskConfig(name="dataset", path=TRL, answer_key="solution", reward="tests.unit.test_driver:exiting_reward")
    task = make_task(cfg, build_tokenizer())
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(task))
    driver = _running_driver(buffer, task, StandInEngine(), 1, "task.max_bad_reward_groups_in_a_row=2")
    with pytest.raises(RewardError) as info:
        asyncio.run(asyncio.wait_for(driver.run(), 20))  # the SystemExit ended neither a thread nor this process
    printed = f"megatron-rl train: error: {info.value}"  # what the CLI prints for a UserError
    assert re.fullmatch(
        r"megatron-rl train: error: 2 groups in a row had a failed reward \(task.max_bad_reward_groups_in_a_row\); "
        rf"last: prompt \d: reward 'tests.unit.test_driver:exiting_reward' raised SystemExit: 3 "
        rf"\(prompt {re.escape(TRL)}:\d\)",
        printed,
    ), printed
    # 2 groups, or 3 when the other worker's group was scored meanwhile (its put may be cancelled by the stop).
    assert task.reward_failures in (2, 3) and list(buffer.stats()["dropped_by_reason"]) == ["bad_reward"]
    assert all("SystemExit: 3" in e["error"] for e in task.report()["recent"])


def test_driver_scores_evaluation_responses_without_samples():
    task = CountingTask(bad={1})
    driver = _running_driver(None, task, StandInEngine(), 0)
    assert asyncio.run(driver.score(["a", "b"], {"answer": 0})) == [1.0, 1.0]
    assert math.isnan(asyncio.run(driver.score(["a"], {"answer": 1}))[0]) and task.reward_failures == 1


class CountingCalls:
    """The real buffer behind Ray's call syntax, counting the driver's claims and what each returned."""

    def __init__(self, buffer: RolloutBuffer):
        self.buffer, self.claims = buffer, []

    def __getattr__(self, name: str):
        method = getattr(self.buffer, name)

        async def call(*args):
            result = await asyncio.to_thread(method, *args)
            if name == "claim_gated" and result["prompts"]:
                self.claims.append([index for index, _ in result["prompts"]])
            return result

        return types.SimpleNamespace(remote=call)


def test_a_steps_prompts_go_out_in_a_claim_or_two_and_a_stop_gives_unstarted_ones_back():
    # 4 prompts a step, 4 workers on the engine, on-policy: a claim takes a prompt for each free worker, so a
    # step's prompts reach the engine together (it batches them), not one claim and one look at the counts per
    # prompt. A worker that comes back while the others still deliver their groups waits in the buffer for one
    # prompt; those that come back after it claim the rest at once.
    buffer = RolloutBuffer(capacity=16, prompts=PromptStream(CountingTask()))
    calls = CountingCalls(buffer)
    cfg = load_config(
        "configs/quickstart.yaml",
        ["prompts_per_step=4", "rollout.samples_per_prompt=1", "rollout.max_concurrent_prompts=4"],
    )
    engine = StandInEngine()
    driver = GenerationDriver(calls, {"e0": engine}, CountingTask(), StandInTokenizer(), cfg, lag=0)

    async def scenario():
        run = asyncio.create_task(driver.run())
        try:
            for version in range(3):
                await _until(lambda: buffer.stats()["buffered"] == 4)
                assert len(await asyncio.to_thread(buffer.get_batch, 4, version, 5.0)) == 4
                buffer.set_trainer_version(version + 1)
            await _until(lambda: buffer.stats()["buffered"] == 4)
        finally:
            driver.stop()
            await asyncio.wait_for(run, 10)

    asyncio.run(scenario())
    assert calls.claims[0] == [0, 1, 2, 3]  # at the start every worker is free
    # The first claim's 4 groups went to the engine in one call; every prompt went out once, in a call per burst.
    # One engine call per claim (this driver has one engine), with that claim's prompts.
    assert engine.burst_calls[0] == [0, 1, 2, 3], engine.burst_calls
    assert [sorted(call) for call in engine.burst_calls] == calls.claims[: len(engine.burst_calls)]
    assert len(engine.burst_calls) >= len(calls.claims) - 1  # the last claim's may have been cut by the stop
    steps = [[claim for claim in calls.claims if claim[0] // 4 == step] for step in range(4)]
    assert all(sum(steps[step], []) == list(range(4 * step, 4 * step + 4)) for step in range(4))
    assert all(len(claims) <= 2 for claims in steps), calls.claims
    assert driver.trainer_version == 3  # as the buffer told it with the claims (the launcher's evaluations follow it)
    counts = buffer.check_accounting()
    assert counts["in_flight"] == 0 and counts["dropped"] == 0  # nothing claimed was left hanging at the stop


def test_a_claim_deals_prompts_over_the_engines_free_workers():
    driver = _driver(limit=3)
    driver.engines = {"a": None, "b": None, "c": None}
    driver.mark_down("c", "ActorDiedError")
    driver._busy["a"] = driver.cfg.rollout.max_concurrent_prompts - 1  # one free worker left on engine a
    free = driver._free_workers()
    assert free == {"a": 1, "b": driver.cfg.rollout.max_concurrent_prompts}
    claimed = [(i, {}) for i in range(4)]
    driver._deal(claimed, "b", free)
    assert [i for i, *_ in driver._claimed["b"]] == [0, 2, 3] and [i for i, *_ in driver._claimed["a"]] == [1]
    assert not driver._claimed["c"]
    # Each engine's share of the claim is one burst, of as many calls as it was dealt (rollout/burst.py).
    (b_burst,) = {burst for *_, burst in driver._claimed["b"]}
    (a_burst,) = {burst for *_, burst in driver._claimed["a"]}
    assert b_burst[1] == 3 and a_burst[1] == 1 and a_burst[0] != b_burst[0]
    driver._deal([(4, {})], "a", {"a": 1, "b": 0})
    assert driver._claimed["a"][-1][2][0] not in (a_burst[0], b_burst[0])  # a new claim, a new burst


@pytest.mark.parametrize("lag", [0, 1])
def test_prompts_dealt_to_every_engine_are_served_while_a_worker_waits_at_the_gate(lag):
    # Two engines of two workers, two prompts a step: a claim for the four free workers gets the step's two and
    # deals one to each engine. A worker of the first engine that then finds the gate shut must not keep the
    # second engine's workers from the prompt dealt to them (it held the claim lock through its gate waits, and
    # the step never filled).
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    engines = {"e0": StandInEngine(), "e1": StandInEngine()}
    cfg = load_config(
        "configs/quickstart.yaml",
        ["prompts_per_step=2", "rollout.samples_per_prompt=1", "rollout.max_concurrent_prompts=2"],
    )
    driver = GenerationDriver(LocalActor(buffer), engines, CountingTask(), StandInTokenizer(), cfg, lag=lag)

    async def scenario():
        run = asyncio.create_task(driver.run())
        try:
            for version in range(3):
                batch = await asyncio.to_thread(buffer.get_batch, 2, version, 5.0)
                assert len(batch) == 2, f"step {version + 1} did not fill: {buffer.check_accounting()}"
                buffer.set_trainer_version(version + 1)
        finally:
            driver.stop()
            await asyncio.wait_for(run, 10)

    asyncio.run(scenario())
    assert all(engine.burst_calls for engine in engines.values())  # both engines served prompts
    assert buffer.check_accounting()["consumed"] == 6


def test_a_resumed_driver_claims_nothing_and_follows_no_version_until_the_trainer_says_its_own():
    # The state of a run one step ahead saved at step 2 (prompts 4 and 5 in flight, the trainer at version 1).
    # The new engine holds the start-up weights until the trainer pushes step 2's: the driver claims nothing and
    # does not take version 1 for the engines' (the launcher's evaluations follow it).
    buffer = RolloutBuffer(capacity=8, prompts=PromptStream(CountingTask()))
    buffer.load_state_dict(run_to_a_save(per_step=2, steps=2))
    driver = _running_driver(buffer, CountingTask(), StandInEngine(), 1)

    async def scenario():
        run = asyncio.create_task(driver.run())
        try:
            await asyncio.sleep(0.5)
            before = (driver.stats.claimed, driver.trainer_version)
            buffer.set_trainer_version(2)  # the trainer loaded step 2 and pushed it
            await _until(lambda: buffer.stats()["buffered"] == 4)  # steps 3 and 4: the requeued 4, 5 first
            return before
        finally:
            driver.stop()
            await asyncio.wait_for(run, 10)

    assert asyncio.run(scenario()) == (0, 0)
    assert driver.trainer_version == 2 and buffer.check_accounting()["dropped"] == 0
