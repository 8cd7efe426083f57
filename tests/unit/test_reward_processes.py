"""Reward calls in processes (`task.reward_isolation`): a call past its time is killed with its process while the
event loop runs on, the process is replaced, and what cannot travel between processes is a reason, not an escape.
Real spawned processes; the reward functions live in tests/support/process_rewards.py, light to import there."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import time
from pathlib import Path

import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.models.tiny import build_tokenizer
from megatron_rl.rollout.rewards import RewardRunner, RewardSet, describe, load_reward, math_reward
from megatron_rl.rollout.tasks import make_task
from tests.support.process_rewards import async_exact, exact, holds_the_gil, returns_a_lambda


def _score(runner, fn, responses, answer="1", source=""):
    spec = describe(fn, fn.__name__ if callable(fn) else fn, source=source or fn.__name__)
    records = [{"answer": answer, "source": "t.jsonl:0"}] * len(responses)
    return asyncio.run(RewardSet([spec]).score(responses, records, [None] * len(responses), runner))


def test_a_reward_holding_the_gil_is_killed_at_its_time_while_the_loop_runs_on():
    runner = RewardRunner(timeout_s=60, workers=1, isolation="process")
    assert [s.reward for s in _score(runner, exact, ["1", "2"])] == [1.0, 0.0]  # the process has started
    runner.timeout_s = 1.5
    spec = describe(holds_the_gil, "holds_the_gil")

    async def scenario():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start = time.monotonic()
        scored = await RewardSet([spec]).score(["1"], [{"answer": "1"}], [None], runner)
        ticker.cancel()
        return scored, time.monotonic() - start, ticks

    scored, seconds, ticks = asyncio.run(scenario())
    assert math.isnan(scored[0].reward) and "timed out after task.reward_timeout_s=1.5 s" in scored[0].error
    assert seconds < 3.0 and ticks >= 15  # on a thread the loop would not have ticked once until the sum ended
    assert runner.stuck_threads == 1
    runner.timeout_s = 60
    assert [s.reward for s in _score(runner, exact, ["1"])] == [1.0]  # a new process took the killed one's place
    children = multiprocessing.active_children()
    runner.shutdown()
    deadline = time.monotonic() + 10
    while any(child.is_alive() for child in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(child.is_alive() for child in children)  # shutdown ends the reward processes


def test_the_math_reward_runs_in_a_process_by_default_and_a_power_tower_only_times_out():
    """The response that froze the driver: math-verify's comparison of 9^{9^{9}} (minutes in one C call)."""
    runner = RewardRunner(timeout_s=60, workers=1)
    assert runner.in_process(describe(math_reward, "math", source="math"))
    assert [s.reward for s in _score(runner, math_reward, ["\\boxed{1}"], source="math")] == [1.0]
    runner.timeout_s = 2
    scored = _score(runner, math_reward, ["$9^{9^{9}}$"], source="math")
    assert math.isnan(scored[0].reward) and "timed out" in scored[0].error
    runner.timeout_s = 60
    assert [s.reward for s in _score(runner, math_reward, ["\\boxed{2}"], answer="2", source="math")] == [1.0]
    runner.shutdown()


def test_what_cannot_travel_is_a_reason_and_the_process_serves_on(tmp_path):
    runner = RewardRunner(timeout_s=60, workers=1, isolation="process")
    scored = _score(runner, returns_a_lambda, ["1"])
    assert math.isnan(scored[0].reward) and "returned a value that cannot be sent back" in scored[0].error
    spec = describe(exact, "exact")
    unpicklable = type("Sample", (), {"num_tokens": None, "hook": lambda self: None})()
    unpicklable.fn = lambda: None

    async def send_a_lambda():
        return await RewardSet([spec]).score(["1"], [{"answer": "1"}], [unpicklable], runner)

    scored = asyncio.run(send_a_lambda())
    assert math.isnan(scored[0].reward) and "cannot be sent to a reward process" in scored[0].error
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def doubled(response, answer, sample=None):\n    return 2.0 * (response == str(answer))\n")
    source = f"{reward_file}:doubled"  # a file's function: the process loads the file again
    scored = asyncio.run(
        RewardSet([describe(load_reward(source), "doubled", source=source)]).score(
            ["1", "0"], [{"answer": "1"}] * 2, [None] * 2, runner
        )
    )
    assert [s.reward for s in scored] == [2.0, 0.0]
    gone = tmp_path / "gone.py"
    gone.write_text("def one(response, answer, sample=None):\n    return 1.0\n")
    spec = describe(load_reward(f"{gone}:one"), "one", source=f"{gone}:one")
    gone.unlink()  # loaded here, but the reward process loads the file again

    async def score_twice():
        return [await RewardSet([spec]).score(["1"], [{"answer": "1"}], [None], runner) for _ in range(2)]

    for (scored,) in asyncio.run(score_twice()):
        assert math.isnan(scored.reward)
        assert f"cannot be loaded in a reward process: raised TaskError: reward '{gone}:one': file" in scored.error
    runner.shutdown()


def test_where_each_reward_runs():
    math_spec = describe(math_reward, "math", source="math")
    plain, coroutine = describe(exact, "exact"), describe(async_exact, "async_exact")
    auto, threads, processes = (RewardRunner(1.0, isolation=mode) for mode in ("auto", "thread", "process"))
    assert [auto.in_process(s) for s in (math_spec, plain, coroutine)] == [True, False, False]
    assert [threads.in_process(s) for s in (math_spec, plain, coroutine)] == [False, False, False]
    assert [processes.in_process(s) for s in (math_spec, plain, coroutine)] == [True, True, False]
    with pytest.raises(ValueError, match="reward isolation 'threads': expected one of auto, thread, process"):
        RewardRunner(1.0, isolation="threads")
    with pytest.raises(ValueError, match="reward_isolation"):
        TaskConfig(reward_isolation="threads")
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "trl_math.jsonl"
    task = make_task(TaskConfig(name="jsonl", path=str(fixture), answer_key="solution"), build_tokenizer())
    (own,) = task.reward_set().functions  # a dataset's default reward is the built-in one, not a bound method
    assert (own.fn, own.source, own.name) == (math_reward, "math", "dataset") and auto.in_process(own)
    for runner in (auto, threads, processes):
        runner.shutdown()  # none started a thread or a process
        assert runner._threads._threads == 0 and runner._processes._threads == 0
