"""Reward calls in processes (`task.reward_isolation`): a call past its time is killed with its process while the
event loop runs on, the process is replaced, and what cannot travel between processes is a reason, not an escape.
Real spawned processes; the reward functions live in tests/support/process_rewards.py, light to import there."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.models.tiny import build_tokenizer
from megatron_rl.rollout.rewards import RewardRunner, RewardSet, describe, load_reward, math_reward
from megatron_rl.rollout.rewards import processes as processes_module
from megatron_rl.rollout.tasks import make_task
from tests.support.process_rewards import (
    RefusesToPickle,
    async_exact,
    exact,
    half,
    holds_the_gil,
    leaves_a_child,
    math_verify_imported,
    returns_a_coroutine,
    returns_a_lambda,
    returns_exits_on_load,
    returns_refuses_to_load,
    sleeps_then_exact,
    uses_a_process,
)

REPO = Path(__file__).resolve().parents[2]


def _score(runner, fn, responses, answer="1", source="", name="", samples=None):
    spec = describe(fn, name or fn.__name__, source=source or fn.__name__)
    records = [{"answer": answer, "source": "t.jsonl:0"}] * len(responses)
    return asyncio.run(RewardSet([spec]).score(responses, records, samples or [None] * len(responses), runner))


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


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

    async def cancelled():  # a stopping driver cancels its calls: a running one is killed with its process
        task = asyncio.ensure_future(RewardSet([spec]).score(["1"], [{"answer": "1"}], [None], runner))
        await asyncio.sleep(1.0)
        busy = [child.pid for child in multiprocessing.active_children()]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return busy

    busy = asyncio.run(cancelled())
    assert busy and _gone(busy, 5.0)
    assert [s.reward for s in _score(runner, exact, ["1"])] == [1.0]
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
    named = "megatron_rl.rollout.tasks:math_reward"  # as the shipped MoE configs name it
    assert auto.in_process(describe(load_reward(named), "math", source=named))
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


def test_a_busy_reward_process_dies_with_the_launcher():
    """SIGTERM to the driver's process skips multiprocessing's exit handler: the kernel's parent-death signal
    ends a reward process busy in a call that would run for minutes."""
    script = (
        "import asyncio, multiprocessing\n"
        "from megatron_rl.rollout.rewards import RewardRunner, RewardSet, describe\n"
        "from tests.support.process_rewards import holds_the_gil\n"
        "async def main():\n"
        "    runner = RewardRunner(timeout_s=600, workers=1, isolation='process')\n"
        "    spec = describe(holds_the_gil, 'holds_the_gil')\n"
        "    call = asyncio.ensure_future(RewardSet([spec]).score(['1'], [{'answer': '1'}], [None], runner))\n"
        "    await asyncio.sleep(2)\n"
        "    print(' '.join(str(c.pid) for c in multiprocessing.active_children()), flush=True)\n"
        "    await call\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert pids and _state(pids[0]) == "R"  # summing
        driver.send_signal(signal.SIGTERM)
        driver.wait(10)
        assert _gone(pids)
    finally:
        driver.kill()
        driver.wait(10)


def test_errors_of_any_kind_are_reasons_and_the_worker_serves_on():
    """What used to end a worker's thread for good (leaving later calls to time out): a ValueError pickling an
    argument, a value that raises where it is read back, a plain function returning a coroutine."""
    runner = RewardRunner(timeout_s=60, workers=1, isolation="process")
    scored = _score(runner, exact, ["1"], samples=[RefusesToPickle()])
    assert "cannot be sent to a reward process (ValueError: no pickling this)" in scored[0].error
    scored = _score(runner, returns_refuses_to_load, ["1"])
    assert "its value cannot be read back (ValueError: not here)" in scored[0].error
    scored = _score(runner, returns_exits_on_load, ["1"])
    assert "its value cannot be read back (SystemExit: bye)" in scored[0].error
    assert [s.reward for s in _score(runner, returns_a_coroutine, ["1", "2"])] == [1.0, 0.0]
    assert [s.reward for s in _score(runner, uses_a_process, ["1"])] == [1.0]  # not a daemon: it may have children
    assert [s.reward for s in _score(runner, exact, ["1"])] == [1.0] and runner.stuck_threads == 0
    # Two functions of one name (from different sources) are two functions there too.
    assert [s.reward for s in _score(runner, half, ["1"], name="same", source="a:half")] == [0.5]
    assert [s.reward for s in _score(runner, exact, ["1"], name="same", source="b:exact")] == [1.0]
    runner.shutdown()


def test_started_processes_have_loaded_and_warmed_up_their_functions_before_the_first_call():
    runner = RewardRunner(timeout_s=60, workers=2, isolation="process")
    runner.start([describe(math_reward, "math", source="math")])
    deadline = time.monotonic() + 60
    while len(multiprocessing.active_children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    # Imported at start by math's warm-up in both processes, not by any call of math's.
    assert [s.reward for s in _score(runner, math_verify_imported, ["1", "2"])] == [1.0, 1.0]
    runner.shutdown()


def test_a_child_the_reward_left_holding_the_pipe_neither_blocks_the_worker_nor_outlives_the_kill():
    runner = RewardRunner(timeout_s=60, workers=1, isolation="process")
    assert [s.reward for s in _score(runner, exact, ["1"])] == [1.0]
    runner.timeout_s = 1.0
    scored = _score(runner, leaves_a_child, ["1"])
    assert "timed out" in scored[0].error
    runner.timeout_s = 60
    start = time.monotonic()
    assert [s.reward for s in _score(runner, exact, ["1"])] == [1.0]
    assert time.monotonic() - start < 20  # not after the left-behind child's 31.5 s
    left = subprocess.run(["pgrep", "-f", "sleep 31.5"], capture_output=True, text=True).stdout.split()
    assert _gone([int(pid) for pid in left], 5.0)  # killed with the reward's process group
    runner.shutdown()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_calls_time_runs_from_its_start_not_from_its_wait_for_a_worker(isolation):
    """One worker, three calls of 0.4 s each at once, 0.7 s each: the third starts 0.8 s after it was made (and in a
    process, the first waits for the process to start and import). The time waiting counted before: the second
    and third failed as "timed out" without having run long, their groups dropped."""
    runner = RewardRunner(timeout_s=0.7, workers=1, isolation=isolation)
    start = time.monotonic()
    scored = _score(runner, sleeps_then_exact, ["1", "2", "1"])
    took = time.monotonic() - start
    runner.shutdown()
    assert [s.reward for s in scored] == [1.0, 0.0, 1.0], [s.error for s in scored]
    assert took >= 1.2 and runner.stuck_threads == 0


def test_a_reward_process_that_cannot_start_fails_the_queued_calls_at_once(monkeypatch):
    """Every call queued behind a failing start used to wait out a start of its own (up to 120 s each, one after
    the other); within START_RETRY_S of a failed start, calls fail at once with its reason."""

    class CannotStart:
        def __init__(self, *args):
            time.sleep(0.3)
            raise RuntimeError("no processes today")

    monkeypatch.setattr(processes_module, "_Child", CannotStart)
    runner = RewardRunner(timeout_s=5, workers=1, isolation="process")
    start = time.monotonic()
    scored = _score(runner, exact, ["1"] * 6)
    took = time.monotonic() - start
    runner.shutdown()
    why = "reward 'exact' no reward process: RuntimeError: no processes today (prompt t.jsonl:0)"
    assert all(s.error == why for s in scored), scored
    assert took < 1.5, took  # one start tried (0.3 s), not six


def test_calls_no_worker_ever_starts_fail_after_their_wait_bound():
    runner = RewardRunner(timeout_s=0.05, workers=0, isolation="thread")  # no worker: nothing starts
    start = time.monotonic()
    scored = _score(runner, exact, ["1", "1"])
    took = time.monotonic() - start
    why = "reward 'exact' not started within 10 x task.reward_timeout_s=0.05 s: every reward worker stayed busy"
    assert all(s.error.startswith(why) for s in scored), scored
    assert 0.45 < took < 2.0, took


def test_a_cancelled_call_that_never_returns_holds_no_worker():
    """A stopping evaluation cancels its reward calls; a running one that never returns kept its (only) thread,
    and every later call waited for a worker."""
    runner = RewardRunner(timeout_s=0.5, workers=1, isolation="thread")
    release = threading.Event()
    never = describe(lambda response, answer, sample: release.wait(), "never")

    async def cancel_then_call():
        stuck = asyncio.ensure_future(runner.call(never, ("x", "1", None), {}))
        await asyncio.sleep(0.1)  # running on the one thread
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)
        start = time.monotonic()
        value = await runner.call(describe(exact, "exact"), ("1", "1", None), {})
        return value, time.monotonic() - start

    try:
        value, took = asyncio.run(cancel_then_call())
    finally:
        release.set()
        runner.shutdown()
    assert value == 1.0 and took < 0.4, took
