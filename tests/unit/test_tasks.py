"""Tasks: built-in prompts and rewards (chance level, perfect responses), configured and failing rewards through
`Task.score`/`score_group` (counted, logged with the prompt's source, the group dropped), the data position of a
generated task. Datasets: test_data.py; reward functions: test_rewards.py."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import random

import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.rollout.buffer import RolloutBuffer
from megatron_rl.rollout.tasks import CopyTask, CountTask, PromptStream, TaskError, make_task
from megatron_rl.rollout.types import Group, Sample


@pytest.fixture(scope="module")
def tokenizer():
    from megatron_rl.models.tiny import build_tokenizer

    return build_tokenizer()


# Rewards importable by dotted path from this module.
def constant_reward(response, answer, sample=None):
    return 0.5


def raising_reward(response, answer, sample=None):
    raise ZeroDivisionError("boom")


def nan_reward(response, answer, sample=None):
    return float("nan")


def string_reward(response, answer, sample=None):
    return "1.0"


NOT_CALLABLE = 3


def random_responses(tokenizer, n: int, length: int = 8, seed: int = 0) -> list[str]:
    """Responses of a uniformly random policy over the non-special vocabulary."""
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size()
    return [tokenizer.decode([rng.randrange(3, vocab) for _ in range(length)]) for _ in range(n)]


def test_count_task_prompts_are_deterministic_and_tokenized(tokenizer):
    task = CountTask(tokenizer, seed=3)
    first = [p for _, p in zip(range(5), task.prompts())]
    assert first == [p for _, p in zip(range(5), CountTask(tokenizer, seed=3).prompts())]
    assert [p for _, p in zip(range(2), task.prompts(start=3))] == first[3:5]  # random access
    assert first != [p for _, p in zip(range(5), task.prompts(epoch=1))]
    for record in first:
        assert record["prompt"].startswith("count: ") and record["answer"] == 8
        assert tokenizer.decode(record["prompt_ids"]) == record["prompt"]
        json.dumps(record)


@pytest.mark.parametrize("cls", [CountTask, CopyTask])
def test_builtin_chance_level_and_perfect_response(tokenizer, cls):
    task = cls(tokenizer)
    records = [p for _, p in zip(range(200), task.prompts())]
    responses = random_responses(tokenizer, len(records))
    chance = sum(task.reward(r, p["answer"]) for r, p in zip(responses, records)) / len(records)
    assert abs(chance - task.chance_level) < 0.02, chance
    assert chance < 0.1
    for record in records[:20]:
        perfect = str(record["answer"])[0] * 8 if cls is CopyTask else "01234567"
        assert task.reward(perfect, record["answer"]) == 1.0
        assert task.reward("", record["answer"]) == 0.0


def test_copy_task_needs_the_prompt(tokenizer):
    task = CopyTask(tokenizer)
    records = [p for _, p in zip(range(500), task.prompts())]
    assert {p["answer"] for p in records} == set("0123456789")
    assert all(p["prompt"] == f"repeat {p['answer']}:" for p in records)
    blind = sum(task.reward("77777777", p["answer"]) for p in records) / len(records)
    assert abs(blind - 0.28) < 0.05  # the best prompt-blind policy
    assert task.reward("7777", "7") == 0.5 and task.reward("3333", "7") == pytest.approx(0.1)


def test_count_task_reward_is_capped(tokenizer):
    task = CountTask(tokenizer)
    assert task.reward("123456789012", 8) == 1.0
    assert task.reward("the 12 of 34", 8) == 0.5
    assert task.reward("²³ unicode digits do not count ٣", 8) == 0.0


@pytest.mark.parametrize(
    "fn, error",
    [
        ("raising_reward", "raised ZeroDivisionError: boom"),
        ("nan_reward", "returned nan"),
        ("string_reward", "returned '1.0'"),
    ],
)
def test_failing_rewards_are_caught_counted_and_drop_the_group(tokenizer, fn, error):
    path = f"tests.unit.test_tasks:{fn}"
    task = make_task(TaskConfig(name="count", reward=path), tokenizer)
    buffer = RolloutBuffer(prompts=PromptStream(task), capacity=4)
    (index, record), *_ = buffer.claim_prompts(1)
    samples = [Sample(record["prompt_ids"], [20, 21], [-1.0, -1.0], [0, 0], prompt_index=index) for _ in range(2)]
    for sample in samples:
        sample.reward = task.score("12", record["answer"], sample, record)
    assert math.isnan(samples[0].reward)
    assert task.reward_failures == 2
    where = f" (prompt {record['source']})"
    assert task.report()["recent"][0] == {"prompt_index": index, "error": f"reward {path!r} {error}{where}"}
    assert error in samples[0].metadata["reward_error"]
    assert buffer.put_group(Group(index, samples)) is False
    drop = buffer.stats()["recent_drops"][-1]
    assert drop["prompt_index"] == index and drop["reason"] == "bad_reward" and error in drop["detail"]
    buffer.check_accounting()


def test_score_uses_the_configured_reward(tokenizer):
    task = make_task(TaskConfig(name="copy", reward="tests.unit.test_tasks:constant_reward"), tokenizer)
    assert task.score("anything", "3") == 0.5 and task.reward_failures == 0
    assert make_task(TaskConfig(name="copy"), tokenizer).score("3333", "3") == 0.5


def test_prompt_stream_of_a_generated_task_restores_cheaply(tokenizer):
    stream = PromptStream(CountTask(tokenizer))
    for _ in range(10):
        stream.next()
    restored = PromptStream(CountTask(tokenizer))
    restored.load_state_dict(stream.state_dict())
    assert restored.next() == stream.next()
    assert restored.position == 11
    shipped = pickle.loads(pickle.dumps(stream))  # as Ray ships it to the buffer actor, mid-stream
    assert shipped.next() == restored.next()


def test_make_task_loads_the_tokenizer_of_a_checkpoint_folder(tmp_path):
    from megatron_rl.models.tiny import save_tokenizer

    save_tokenizer(tmp_path)
    task = make_task(TaskConfig(name="count"), str(tmp_path))
    record = next(task.prompts())
    assert task.tokenizer.decode(record["prompt_ids"]) == record["prompt"]


def test_reward_failures_are_counted_exactly_from_many_threads_and_the_task_still_pickles(tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    task = make_task(TaskConfig(name="count", reward="tests.unit.test_tasks:raising_reward"), tokenizer)
    task = pickle.loads(pickle.dumps(task))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: task.score("x", "y"), range(4000)))
    assert task.reward_failures == 4000
    assert len(pickle.loads(pickle.dumps(task)).reward_failure_log) == 100


def exiting_reward(response, answer, sample=None):
    raise SystemExit(1)


def test_score_group_keeps_each_component_and_a_sys_exit_is_a_failed_reward(tokenizer):
    cfg = TaskConfig(
        name="count",
        rewards=[{"fn": "tests.unit.test_tasks:constant_reward", "weight": 2.0}, {"fn": "math_basic"}],
        length_penalty={"coef": 0.5},
    )
    task = make_task(cfg, tokenizer)
    task.set_response_limit(4)
    record = next(task.prompts())
    samples = [Sample(record["prompt_ids"], [5, 6], [-1.0, -1.0], [0, 0], prompt_index=0) for _ in range(2)]
    rewards = asyncio.run(task.score_group(["8", "no digits"], record, samples))
    assert rewards == [2.0 * 0.5 + 1.0 - 0.25, 2.0 * 0.5 - 0.25]
    assert samples[0].metadata["rewards"] == {"constant_reward": 0.5, "math_basic": 1.0, "length_penalty": -0.25}
    exits = make_task(TaskConfig(name="count", reward="tests.unit.test_tasks:exiting_reward"), tokenizer)
    assert math.isnan(exits.score("1", 8)) and exits.reward_failures == 1  # and this test process is still here
    assert "raised SystemExit: 1" in exits.report()["recent"][0]["error"]


def test_make_task_errors(tokenizer):
    with pytest.raises(TaskError, match="task.name='nope' is not a task .*count, dataset, jsonl, parquet"):
        make_task(TaskConfig.model_construct(name="nope", reward="", rewards=[]), tokenizer)
    with pytest.raises(TaskError, match=r"task.overlong_penalty: .*buffer_tokens=9 must be in 1..max_tokens=8"):
        make_task(TaskConfig(overlong_penalty={"buffer_tokens": 9, "max_tokens": 8}), tokenizer)
    task = make_task(TaskConfig(overlong_penalty={"buffer_tokens": 4}), tokenizer)
    with pytest.raises(TaskError, match=r"task.overlong_penalty: .*buffer_tokens=4 must be in 1..max_tokens=2"):
        task.set_response_limit(2)  # max_tokens 0: the engines' limit, known at start-up (launcher.prepare_run)
    task = make_task(TaskConfig(overlong_penalty={"buffer_tokens": 4, "max_tokens": 100}), tokenizer)
    with pytest.raises(TaskError, match=r"max_tokens=100 is above rollout.max_new_tokens=8: .* never apply"):
        task.set_response_limit(8)
    with pytest.raises(TaskError, match="cannot tell how to call it"):
        make_task(TaskConfig(reward="json:dumps"), tokenizer)
