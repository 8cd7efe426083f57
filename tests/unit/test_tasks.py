"""Tasks: built-in prompts and rewards (chance level, perfect responses), dataset files with bad rows, dotted-path
and failing rewards, the data position."""

from __future__ import annotations

import json
import math
import pickle
import random
import re

import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.rollout.buffer import RolloutBuffer
from megatron_rl.rollout.tasks import (
    CopyTask,
    CountTask,
    DatasetTask,
    PromptStream,
    TaskError,
    encode,
    extract_answer,
    load_reward,
    make_task,
    math_reward,
)
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
    "response, answer, expected",
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("3/4 of it, then 0.75", "3/4", 1.0),
        ("We get 1,234 apples", 1234, 1.0),
        ("first 5 then 7", "5", 0.0),  # the last number counts
        ("-3", "#### -3", 1.0),  # GSM8K-style reference
        ("\\boxed{x+1}", "\\boxed{x + 1}", 1.0),  # non-numeric: compared as text
        ("\\boxed{x+2}", "x+1", 0.0),
        ("no number here", "1", 0.0),
        ("42.0000001", 42, 1.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_extract_answer_nested_boxed():
    assert extract_answer("\\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert extract_answer("is 7 or 8?") == "8"
    assert extract_answer("the list 1,2,3") == "3"
    assert extract_answer("costs 12,345.5 dollars") == "12,345.5"


def test_load_reward_dotted_paths():
    assert load_reward("tests.unit.test_tasks:constant_reward")("x", 1) == 0.5
    assert load_reward("tests.unit.test_tasks.constant_reward")("x", 1) == 0.5
    assert load_reward("megatron_rl.rollout.tasks:math_reward")("\\boxed{2}", 2) == 1.0
    with pytest.raises(TaskError, match="'no_such.module:f': cannot import module 'no_such.module'"):
        load_reward("no_such.module:f")
    with pytest.raises(TaskError, match="'tests.unit.test_tasks:missing': module 'tests.unit.test_tasks' has no"):
        load_reward("tests.unit.test_tasks:missing")
    with pytest.raises(TaskError, match="'NOT_CALLABLE' is a int, not a function"):
        load_reward("tests.unit.test_tasks:NOT_CALLABLE")
    with pytest.raises(TaskError, match="expected 'package.module:function'"):
        load_reward("justaname")


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
        sample.reward = task.score("12", record["answer"], sample)
    assert math.isnan(samples[0].reward)
    assert task.reward_failures == 2
    assert task.report()["recent"][0] == {"prompt_index": index, "error": f"reward {path!r} {error}"}
    assert error in samples[0].metadata["reward_error"]
    assert buffer.put_group(Group(index, samples)) is False
    drop = buffer.stats()["recent_drops"][-1]
    assert drop["prompt_index"] == index and drop["reason"] == "bad_reward" and error in drop["detail"]
    buffer.check_accounting()


def test_score_uses_the_configured_reward(tokenizer):
    task = make_task(TaskConfig(name="copy", reward="tests.unit.test_tasks:constant_reward"), tokenizer)
    assert task.score("anything", "3") == 0.5 and task.reward_failures == 0
    assert make_task(TaskConfig(name="copy"), tokenizer).score("3333", "3") == 0.5


def write_rows(tmp_path, fmt: str, rows: list[dict]):
    if fmt == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


BAD_ROWS = [
    {"question": "What is 1 + 1?", "solution": "2"},
    {"question": "", "solution": "3"},  # row 1: empty prompt
    {"question": "What is 2 + 2?", "solution": None},  # row 2: missing answer
    {"question": "the " * 40 + "?", "solution": "4"},  # row 3: too long
    {"question": "What is 5 + 5?", "solution": "10"},
    {"solution": "11"},  # row 5: no prompt field
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_dataset_task_skips_and_counts_bad_rows(tmp_path, tokenizer, fmt):
    path = write_rows(tmp_path, fmt, BAD_ROWS)
    cfg = TaskConfig(name=fmt, path=str(path), prompt_key="question", answer_key="solution", max_prompt_tokens=20)
    task = make_task(cfg, tokenizer, seed=1)
    assert isinstance(task, DatasetTask) and len(task) == 2
    assert dict(task.skipped) == {"missing_prompt": 2, "missing_answer": 1, "too_long": 1}
    where = {(e["file"], e["row"], e["reason"]) for e in task.skipped_log}
    assert where == {
        (str(path), 1, "missing_prompt"),
        (str(path), 2, "missing_answer"),
        (str(path), 3, "too_long"),
        (str(path), 5, "missing_prompt"),
    }
    assert re.search(r"row 3: \d+ prompt tokens > max_prompt_tokens=20", task.skip_summary())
    epoch0 = list(task.prompts(0))
    assert sorted(p["source"] for p in epoch0) == [f"{path}:0", f"{path}:4"]
    assert {p["answer"] for p in epoch0} == {"2", "10"}
    assert all(encode(tokenizer, p["prompt"]) == p["prompt_ids"] for p in epoch0)
    assert task.score("so \\boxed{10}", "10") == 1.0
    assert task.report()["skipped"] == dict(task.skipped)


def test_dataset_task_errors(tmp_path, tokenizer):
    with pytest.raises(TaskError, match="does not exist"):
        DatasetTask(tmp_path / "none.jsonl", tokenizer)
    path = write_rows(tmp_path, "jsonl", BAD_ROWS)
    with pytest.raises(TaskError, match="no column 'prompt', 'answer'.*set task.prompt_key"):
        DatasetTask(path, tokenizer)
    with pytest.raises(TaskError, match="no usable rows out of 6.*row 0"):
        DatasetTask(path, tokenizer, prompt_key="question", answer_key="solution", max_prompt_tokens=2)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "answer": "1"}\n{not json\n')
    with pytest.raises(TaskError, match="broken.jsonl: cannot read as jsonl"):
        DatasetTask(broken, tokenizer, fmt="jsonl")
    with pytest.raises(TaskError, match="cannot tell the format"):
        DatasetTask(tmp_path / "x.csv", tokenizer)
    with pytest.raises(TaskError, match="needs task.path"):
        make_task(TaskConfig(name="jsonl"), tokenizer)
    # The schema refuses an unknown task name before any task is built; make_task still guards direct callers.
    from megatron_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="task.name: must be one of 'count', 'copy', 'jsonl' or 'parquet'"):
        load_config(None, ["task.name=nope"])
    with pytest.raises(TaskError, match="task.name='nope' is not a task .*count, jsonl, parquet"):
        make_task(TaskConfig.model_construct(name="nope", reward=""), tokenizer)


def test_prompt_stream_epochs_and_restore(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    task = DatasetTask(write_rows(tmp_path, "jsonl", rows), tokenizer, shuffle_seed=7)
    stream = PromptStream(task, epochs=2)
    got = [stream.next() for _ in range(7)]
    assert [i for i, _ in got] == list(range(7))
    first, second = [p["source"] for _, p in got[:5]], [p["source"] for _, p in got[5:]]
    assert sorted(first) == sorted({p["source"] for p in task.prompts(0)})  # each row once per epoch
    assert first != [p["source"] for p in task.prompts(1)]  # reshuffled per epoch
    state = json.loads(json.dumps(stream.state_dict()))
    rest = [stream.next() for _ in range(4)]
    assert rest[-1] is None and stream.exhausted  # 2 epochs x 5 rows
    restored = PromptStream(DatasetTask(task.path, tokenizer, shuffle_seed=7), epochs=2)
    restored.load_state_dict(state)
    assert [restored.next() for _ in range(4)] == rest
    assert second == [p["source"] for p in task.prompts(1)][:2]


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
