"""Rewards: math-verify on a table of answer forms (in the main thread and in reward threads), the basic parser it
replaces, the three calling conventions (ours, verl, TRL; batched and async), weighted sums with each component
kept, the length penalties, and every failure (raise, sys.exit, timeout, bad value, bad module) counted, never an
escape."""

from __future__ import annotations

import asyncio
import math
import pickle
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.rollout import rewards as rewards_module
from megatron_rl.rollout.rewards import (
    InlineRunner,
    LengthPenalty,
    OverlongPenalty,
    RewardRunner,
    RewardSet,
    basic_math_reward,
    configured_functions,
    describe,
    load_reward,
    math_reward,
    math_verify_reward,
    shapers,
)
from megatron_rl.rollout.rewards import math as math_module
from megatron_rl.rollout.types import Sample, TaskError

# (response, reference, expected): the default math reward (math-verify) on the answer forms of real datasets.
MATH_TABLE = [
    ("The answer is $x=3$.", "3", 1.0),
    ("so \\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("the point $(1, 2)$", "(1,2)", 1.0),
    ("$2\\pi$", "2\\pi", 1.0),
    ("$10\\%$", "10", 1.0),
    ("42", "42", 1.0),
    ("so the answer is \\boxed{7}.", "7", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("final answer: 3/4", "0.75", 1.0),
    ("We get 1,234 apples", "1234", 1.0),
    ("-3", "#### -3", 1.0),  # GSM8K's reference form
    ("\\boxed{x+1}", "x + 1", 1.0),
    ("\\boxed{[1,3)}", "[1,3)", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{x^2-1}", "(x-1)(x+1)", 1.0),
    ("\\boxed{\\infty}", "\\infty", 1.0),
    ("\\boxed{y = 2x + 1}", "2x+1", 1.0),
    ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0),
    ("\\boxed{A}", "A", 1.0),
    ("\\boxed{x \\in (0, 1]}", "(0,1]", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sin(\\pi/3)", 1.0),
    ("\\boxed{0.3333333}", "1/3", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{2, 3}", "3, 2", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{12}", 12, 1.0),  # a numeric reference cell
    ("first 5 then 7", "5", 0.0),  # the last answer counts
    ("\\boxed{x+2}", "x+1", 0.0),
    ("no number here", "1", 0.0),
    ("\\boxed{1/3}", "0.333", 0.0),  # not equal at math-verify's 6-digit rounding
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{3}", 0.0),
    ("\\boxed{(1,2)}", "(2,1)", 0.0),  # tuples are ordered
    ("", "4", 0.0),
]
ISSUE_ANSWERS = [("x=3", "3"), ("\\sqrt 2", "\\sqrt{2}"), ("\\frac12", "0.5"), ("(1, 2)", "(1,2)"),
                 ("2\\pi", "2\\pi"), ("10\\%", "10"), ("42", "42"), ("\\boxed{7}", "7")]  # fmt: skip


def test_math_table_in_the_main_thread():
    got = [math_reward(response, answer) for response, answer, _ in MATH_TABLE]
    wrong = [(r, a, e, g) for (r, a, e), g in zip(MATH_TABLE, got) if g != e]
    assert not wrong, wrong
    assert len(MATH_TABLE) >= 30 and sum(got) == 33


def test_math_table_in_reward_threads():
    # math-verify's own timeouts use signals, which only the main thread may set: off in threads, and it works.
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda case: math_reward(case[0], case[1]), MATH_TABLE))
    assert got == [expected for _, _, expected in MATH_TABLE]


def test_math_verify_scores_the_issues_answers_and_the_basic_parser_does_not():
    boxed = [(f"the answer is \\boxed{{{r}}}", a) for r, a in ISSUE_ANSWERS]
    assert [math_verify_reward(r, a) for r, a in boxed] == [1.0] * 8
    assert [basic_math_reward(r, a) for r, a in boxed] == [0.0] * 6 + [1.0] * 2


def test_math_reward_falls_back_to_the_basic_parser_without_math_verify(monkeypatch):
    monkeypatch.setattr(math_module, "_math_verify", lambda: None)
    assert math_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0  # the basic parser reads this one
    assert (
        math_reward("\\boxed{x=3}", "3") == 0.0 and math_reward("$\\sqrt 2$", "\\sqrt{2}") == 1.0
    )  # wrongly: it reads both as 2
    with pytest.raises(ImportError, match="pip install 'math-verify"):
        math_verify_reward("1", "1")


def test_an_unreadable_reference_answer_is_a_failed_reward():
    with pytest.raises(ValueError, match="cannot read the reference answer"):
        math_verify_reward("\\boxed{1}", "")


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("3/4 of it, then 0.75", "3/4", 1.0),
        ("We get 1,234 apples", 1234, 1.0),
        ("first 5 then 7", "5", 0.0),
        ("-3", "#### -3", 1.0),
        ("\\boxed{x+1}", "\\boxed{x + 1}", 1.0),  # non-numeric: compared as text
        ("\\boxed{x+2}", "x+1", 0.0),
        ("no number here", "1", 0.0),
        ("42.0000001", 42, 1.0),
    ],
)
def test_basic_math_reward(response, answer, expected):
    assert basic_math_reward(response, answer) == expected


def test_extract_answer_nested_boxed():
    assert math_module.extract_answer("\\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert math_module.extract_answer("is 7 or 8?") == "8"
    assert math_module.extract_answer("the list 1,2,3") == "3"
    assert math_module.extract_answer("costs 12,345.5 dollars") == "12,345.5"


# ---------------------------------------------------------------------------------------------------------------
# Calling conventions. Each reward below records what it received.

RECEIVED: list = []

VERL_RECORD = {
    "prompt": "user: What is 2 + 3?\nassistant:",
    "messages": [{"role": "user", "content": "What is 2 + 3?"}],
    "answer": "5",
    "source": "verl.parquet:4",
    "data_source": "arith/add",
    "row": {"data_source": "arith/add", "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 4}},
}
TRL_RECORD = {
    "prompt": "Compute 3 * 4.",
    "answer": "12",
    "source": "trl.jsonl:0",
    "data_source": "trl.jsonl",
    "row": {"solution": "12", "level": 2},
}


def ours(response, answer, sample):
    RECEIVED.append(("ours", response, answer, sample))
    return 1.0 if answer in response else 0.0


def ours_with_row(response, answer, sample, row):
    RECEIVED.append(("ours_row", row))
    return 0.5


def ours_batched(responses, answers, samples):
    RECEIVED.append(("ours_batch", list(responses), list(answers)))
    return [float(len(r)) for r in responses]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    RECEIVED.append(("verl", data_source, solution_str, ground_truth, extra_info))
    return {"score": 1.0 if ground_truth in solution_str else 0.0, "acc": True, "pred": solution_str[-2:]}


def compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos):
    RECEIVED.append(("verl_batch", data_sources, ground_truths, extra_infos))
    return [0.25] * len(solution_strs)


def trl_reward(prompts, completions, **kwargs):
    RECEIVED.append(("trl", prompts, completions, kwargs))
    return [1.0 if kwargs["solution"][i] in c else 0.0 for i, c in enumerate(completions)]


def trl_chat_reward(prompts, completions, completion_ids, **kwargs):
    RECEIVED.append(("trl_chat", prompts, completions, completion_ids))
    return [None, 2.0]  # None: does not apply to the first completion


async def async_reward(response, answer, sample):
    await asyncio.sleep(0.01)
    return 0.75


def exits(response, answer, sample):
    sys.exit(3)


def raises(response, answer, sample):
    raise ZeroDivisionError("boom")


async def async_exits(response, answer, sample):
    sys.exit("bye")


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def sleeps(response, answer, sample):
    time.sleep(1.0)
    return 1.0


def records_and_sleeps(response, answer, sample):
    RECEIVED.append(("records_and_sleeps", response))
    time.sleep(1.0)
    return 1.0


async def async_sleeps(response, answer, sample):
    await asyncio.sleep(5)


def returns_array(response, answer, sample):
    return np.array([0.5, 0.2])  # it ended the run (a ValueError from `.item()` outside the guarded call)


def returns_text(response, answer, sample):
    return "1.0"


def no_convention(text):
    return 1.0


def _samples(n: int, tokens: int = 3) -> list[Sample]:
    return [Sample([1, 2], [7] * tokens, [-0.5] * tokens, [i] * tokens, prompt_index=9) for i in range(n)]


def _score(functions, record, responses, runner=None, shaping=None):
    rewards = RewardSet([describe(load_reward(f"tests.unit.test_rewards:{f}"), f) for f in functions], shaping)
    return asyncio.run(
        rewards.score(responses, [record] * len(responses), _samples(len(responses)), runner or InlineRunner())
    )


@pytest.fixture(autouse=True)
def _clear_received():
    RECEIVED.clear()


@pytest.mark.parametrize(
    "fn, convention",
    [
        ("ours", "ours"), ("ours_with_row", "ours"), ("ours_batched", "ours_batch"), ("compute_score", "verl"),
        ("compute_score_batched", "verl_batch"), ("trl_reward", "trl"), ("trl_chat_reward", "trl"),
        ("async_reward", "ours"),
    ],
)  # fmt: skip
def test_conventions_are_told_from_the_parameters(fn, convention):
    spec = describe(load_reward(f"tests.unit.test_rewards:{fn}"), fn)
    assert spec.convention == convention
    assert spec.is_async == fn.startswith("async")
    assert spec.wants_row == (fn == "ours_with_row")


def test_a_function_of_no_known_convention_is_refused():
    with pytest.raises(TaskError, match=r"reward 'x': cannot tell how to call it from its parameters \(text\):"):
        describe(no_convention, "x")

    def keywords(*, response, answer, sample):
        return 1.0

    message = r"\(response, answer, sample\) \(response, answer, sample keyword-only: ours passes them by position\)"
    with pytest.raises(TaskError, match=message):
        describe(keywords, "k")


def test_ours_gets_response_answer_sample_and_the_row():
    scored = _score(["ours", "ours_with_row"], VERL_RECORD, ["it is 5", "it is 6"])
    assert [s.reward for s in scored] == [1.5, 0.5]
    assert scored[0].components == {"ours": 1.0, "ours_with_row": 0.5}
    kinds = [r[0] for r in RECEIVED]
    assert kinds.count("ours") == 2 and kinds.count("ours_row") == 2
    _, response, answer, sample = RECEIVED[0]
    assert (response, answer, sample.prompt_index) == ("it is 5", "5", 9)
    assert [r[1] for r in RECEIVED if r[0] == "ours_row"] == [VERL_RECORD["row"]] * 2


def test_verl_gets_data_source_ground_truth_and_extra_info_and_may_return_a_dict():
    scored = _score(["compute_score"], VERL_RECORD, ["\\boxed{5}", "\\boxed{4}"])
    assert [s.reward for s in scored] == [1.0, 0.0]
    assert RECEIVED[0] == ("verl", "arith/add", "\\boxed{5}", "5", {"index": 4})
    assert scored[0].info == {"compute_score": {"acc": True, "pred": "5}"}}


def test_batched_functions_are_called_once_per_group():
    scored = _score(["ours_batched", "compute_score_batched"], VERL_RECORD, ["ab", "abcd", "a"])
    assert [s.reward for s in scored] == [2.25, 4.25, 1.25]
    assert RECEIVED == [
        ("ours_batch", ["ab", "abcd", "a"], ["5", "5", "5"]),
        ("verl_batch", ["arith/add"] * 3, ["5"] * 3, [{"index": 4}] * 3),
    ]


def test_trl_gets_prompts_completions_and_every_other_column_as_lists():
    scored = _score(["trl_reward"], TRL_RECORD, ["12", "13"])
    assert [s.reward for s in scored] == [1.0, 0.0]
    _, prompts, completions, kwargs = RECEIVED[0]
    assert prompts == ["Compute 3 * 4."] * 2 and completions == ["12", "13"]
    assert kwargs["solution"] == ["12", "12"] and kwargs["level"] == [2, 2]
    assert kwargs["completion_ids"] == [[7, 7, 7]] * 2 and kwargs["trainer_state"].global_step == 1


def test_trl_chat_prompts_get_message_completions_and_none_means_does_not_apply():
    scored = _score(["trl_chat_reward", "ours"], VERL_RECORD, ["5", "6"])
    _, prompts, completions, _ = RECEIVED[0]
    assert prompts == [VERL_RECORD["messages"]] * 2
    assert completions == [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]]
    assert [s.reward for s in scored] == [1.0, 2.0]  # TRL's nansum: the None is left out, not a failure
    assert scored[0].components == {"ours": 1.0} and scored[0].error is None
    alone = _score(["trl_chat_reward"], VERL_RECORD, ["5", "6"])
    assert math.isnan(alone[0].reward) and "returned None" in alone[0].error and alone[1].reward == 2.0


def test_async_rewards_are_awaited_by_both_runners():
    assert [s.reward for s in _score(["async_reward"], TRL_RECORD, ["a", "b"])] == [0.75, 0.75]
    runner = RewardRunner(timeout_s=5)

    async def main():
        rewards = RewardSet([describe(async_reward, "a"), describe(ours, "o")])
        return await rewards.score(["12"], [TRL_RECORD], _samples(1), runner)

    assert [s.reward for s in asyncio.run(main())] == [1.75]
    runner.shutdown()


@pytest.mark.parametrize(
    "fn, error",
    [
        ("exits", "reward 'exits' raised SystemExit: 3 (prompt trl.jsonl:0)"),
        ("async_exits", "reward 'async_exits' raised SystemExit: bye (prompt trl.jsonl:0)"),
        ("raises", "reward 'raises' raised ZeroDivisionError: boom (prompt trl.jsonl:0)"),
        ("returns_text", "reward 'returns_text' returned '1.0' (prompt trl.jsonl:0)"),
        (
            "returns_array",
            "reward 'returns_array' returned an array of shape (2,), not one number (prompt trl.jsonl:0)",
        ),
        ("wrong_length", "reward 'wrong_length' returned 1 values for 2 responses"),
    ],
)
@pytest.mark.parametrize("threaded", [False, True])
def test_every_failure_is_a_nan_with_its_reason_never_an_escape(fn, error, threaded):
    runner = RewardRunner(timeout_s=5) if threaded else InlineRunner()
    scored = _score([fn, "ours"], TRL_RECORD, ["12", "x"], runner)  # a failing component fails the sample
    assert all(math.isnan(s.reward) for s in scored)
    assert scored[0].error.startswith(error)
    if threaded:
        runner.shutdown()


def test_a_reward_past_its_time_fails_and_its_thread_is_replaced():
    runner = RewardRunner(timeout_s=0.2)
    start = time.monotonic()
    scored = _score(["sleeps"], TRL_RECORD, ["1"], runner)
    assert math.isnan(scored[0].reward) and "timed out after task.reward_timeout_s=0.2 s" in scored[0].error
    assert runner.stuck_threads == 1
    assert [s.reward for s in _score(["ours"], TRL_RECORD, ["12"], runner)] == [1.0]  # a new thread works at once
    assert time.monotonic() - start < 0.9  # not waiting for the stuck thread
    scored = _score(["async_sleeps"], TRL_RECORD, ["1"], runner)
    assert "timed out" in scored[0].error and runner.stuck_threads == 1  # async ones hold no thread
    runner.shutdown()


def test_each_queued_call_runs_with_its_own_time_and_a_slow_one_still_fails_at_it():
    """With one thread, the group's second call waits in the queue behind the first, which runs past its time: the
    first is given up on 0.3 s after it began (its thread written off), then the second runs and fails at its own
    0.3 s; neither is failed for the time it waited."""
    runner = RewardRunner(timeout_s=0.3, workers=1)
    RECEIVED.clear()
    start = time.monotonic()
    scored = _score(["records_and_sleeps"], TRL_RECORD, ["1", "2"], runner)
    assert all(math.isnan(s.reward) and "timed out" in s.error for s in scored)
    assert 0.55 < time.monotonic() - start < 0.95  # one after the other, each at its own time
    assert RECEIVED == [("records_and_sleeps", "1"), ("records_and_sleeps", "2")] and runner.stuck_threads == 2
    assert [s.reward for s in _score(["ours"], TRL_RECORD, ["12"], runner)] == [1.0]
    runner.shutdown()


def test_cancelled_calls_not_yet_started_never_run_and_a_closed_loop_costs_no_thread():
    """A stopping driver cancels its reward calls: the queued ones are dropped, not run one by one afterwards; a
    call whose loop closed under it leaves its thread serving the next loop; after shutdown calls fail at once."""
    runner = RewardRunner(timeout_s=5, workers=1)
    spec = describe(records_and_sleeps, "records_and_sleeps")
    RECEIVED.clear()

    async def cancel(count: int, linger_s: float):
        calls = [asyncio.ensure_future(runner.call(spec, (str(i), "a", None), {})) for i in range(count)]
        await asyncio.sleep(0.1)  # the first is running on the one thread
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(linger_s)

    asyncio.run(cancel(4, linger_s=1.5))  # the loop lives on: a queued call not dropped would run meanwhile
    assert RECEIVED == [("records_and_sleeps", "0")]
    asyncio.run(cancel(1, linger_s=0))  # the loop closes while the call runs
    time.sleep(1.2)
    assert [s.reward for s in _score(["ours"], TRL_RECORD, ["12"], runner)] == [1.0]  # the thread still serves
    runner.shutdown()
    start = time.monotonic()
    scored = _score(["ours"], TRL_RECORD, ["12"], runner)
    assert "reward calls after the runner was shut down" in scored[0].error and time.monotonic() - start < 1


def test_a_reward_that_never_returns_does_not_keep_the_process_from_exiting():
    """The interpreter joins a ThreadPoolExecutor's threads at exit: a run whose reward hung never ended (its
    launcher waited for the reward's thread after the summary). The reward threads are daemon threads."""
    script = (
        "import asyncio, time\n"
        "from megatron_rl.rollout.rewards import RewardRunner, describe\n"
        "def never(response, answer, sample):\n"
        "    time.sleep(3600)\n"
        "async def main():\n"
        "    runner = RewardRunner(timeout_s=0.2)\n"
        "    try:\n"
        "        await runner.call(describe(never, 'never'), ('x', 'y', None), {})\n"
        "    except Exception as err:\n"
        "        print(err)\n"
        "    runner.shutdown()\n"
        "asyncio.run(main())\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "timed out after task.reward_timeout_s=0.2 s" in done.stdout
    assert time.monotonic() - start < 60  # the import takes seconds; the hung reward would take an hour


# ---------------------------------------------------------------------------------------------------------------
# Weights, names and penalties from the config.


def test_configured_rewards_weights_and_names():
    cfg = TaskConfig(
        rewards=[
            {"fn": "math", "weight": 2.0},
            {"fn": "tests.unit.test_rewards:compute_score", "weight": 0.5, "name": "verl"},
        ]
    )
    functions = configured_functions(cfg)
    assert [(f.name, f.weight, f.convention, f.source) for f in functions] == [
        ("math", 2.0, "ours", "math"),
        ("verl", 0.5, "verl", "tests.unit.test_rewards:compute_score"),
    ]
    scored = asyncio.run(RewardSet(functions).score(["\\boxed{5}"], [VERL_RECORD], _samples(1), InlineRunner()))
    assert scored[0].reward == 2.5 and scored[0].components == {"math": 1.0, "verl": 1.0}
    same = TaskConfig(rewards=[{"fn": "math"}, {"fn": "math"}])
    with pytest.raises(TaskError, match=r"the names \['math'\] repeat"):
        configured_functions(same)
    assert configured_functions(TaskConfig(reward="math_basic"))[0].fn is basic_math_reward


def test_overlong_penalty_is_dapos():
    penalty = OverlongPenalty(buffer_tokens=4, max_tokens=10, factor=1.0)
    assert [penalty(n) for n in (0, 6, 7, 8, 10, 12)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert OverlongPenalty(4, 10, factor=0.5)(9) == -0.375
    with pytest.raises(ValueError, match="buffer_tokens=11 must be in 1..max_tokens=10"):
        OverlongPenalty(11, 10)


def test_length_penalty_is_linear_past_the_free_tokens():
    penalty = LengthPenalty(coef=0.2, max_tokens=12, free_tokens=4)
    assert [penalty(n) for n in (0, 4, 8, 12)] == [0.0, 0.0, pytest.approx(-0.1), pytest.approx(-0.2)]


def test_penalties_wrap_any_reward_and_are_kept_as_components():
    cfg = TaskConfig(overlong_penalty={"buffer_tokens": 2}, length_penalty={"coef": 0.1, "free_tokens": 1})
    shaping = shapers(cfg, max_new_tokens=4)  # max_tokens 0: the engines' max_new_tokens
    assert [type(s).__name__ for s in shaping] == ["OverlongPenalty", "LengthPenalty"]
    scored = _score(["ours"], TRL_RECORD, ["12"], shaping=shaping)  # 3 response tokens of 4
    assert scored[0].components == {"ours": 1.0, "overlong_penalty": -0.5, "length_penalty": pytest.approx(-0.2 / 3)}
    assert scored[0].reward == pytest.approx(1.0 - 0.5 - 0.2 / 3)
    with pytest.raises(TaskError, match=r"task.overlong_penalty: .*buffer_tokens=8 must be in 1..max_tokens=4"):
        shapers(TaskConfig(overlong_penalty={"buffer_tokens": 8}), max_new_tokens=4)


# ---------------------------------------------------------------------------------------------------------------
# Loading.


def test_load_reward_by_name_dotted_path_and_file(tmp_path):
    assert load_reward("math") is math_reward
    assert load_reward("tests.unit.test_rewards:ours") is ours
    assert load_reward("tests.unit.test_rewards.ours") is ours
    assert load_reward("megatron_rl.rollout.tasks:math_reward") is math_reward  # what older configs name
    file = tmp_path / "my_reward.py"
    file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    fn = load_reward(f"{file}:compute_score")
    assert fn("d", "s", "g") == 0.5
    spec = describe(fn, "mine", source=f"{file}:compute_score")
    copy = pickle.loads(pickle.dumps(spec))  # its module is not importable in another process: loaded again there
    assert copy.fn is None and copy.target()("d", "s", "g") == 0.5


@pytest.mark.parametrize(
    "path, error",
    [
        ("no_such.module:f", r"cannot import 'no_such.module': ModuleNotFoundError: No module named 'no_such'"),
        ("tests.unit.test_rewards:missing", r"module 'tests.unit.test_rewards' has no attribute 'missing'"),
        ("tests.unit.test_rewards:RECEIVED", r"'RECEIVED' is a list, not a function"),
        ("justaname", r"expected a built-in name \(math, math_basic\)"),
        ("missing_file.py:f", r"file 'missing_file.py' does not exist"),
        ("my_rewards.py", r"reward 'my_rewards.py': name the function in the file too, as 'my_rewards.py:function'"),
    ],
)
def test_load_reward_errors(path, error):
    with pytest.raises(TaskError, match=error):
        load_reward(path)


@pytest.mark.parametrize(
    "source, error",
    [
        ("def f(:\n", r"SyntaxError: invalid syntax \(.*broken.py line 1, column 7\)"),
        ("import sys\nsys.exit(4)\n", r"SystemExit: 4 \(.*broken.py line 2\)"),
        ("x = 1\nraise RuntimeError('no GPU here')\n", r"RuntimeError: no GPU here \(.*broken.py line 2\)"),
    ],
)
def test_a_reward_file_that_does_not_import_is_one_line_naming_file_and_line(tmp_path, source, error):
    file = tmp_path / "broken.py"
    file.write_text(source)
    with pytest.raises(TaskError, match=f"reward '{file}:f': cannot import '{file}': {error}") as info:
        load_reward(f"{file}:f")
    assert "\n" not in str(info.value)


def test_the_package_exports_what_it_documents():
    assert set(rewards_module.__all__) <= set(dir(rewards_module))
