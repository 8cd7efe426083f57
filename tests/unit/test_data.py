"""Datasets: verl-shaped parquet and TRL-style jsonl rows into prompt records (dotted keys, every other column
kept, chat templates), folders and Hugging Face names (offline, from the local cache), every bad input as one
error naming file, row and column, mixing by weight with a data position that resumes exactly, and the
validation prompts."""

from __future__ import annotations

import collections
import json
import re
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import TaskConfig
from megatron_rl.config.task import DatasetConfig
from megatron_rl.models.tiny import save_tokenizer
from megatron_rl.rollout.data import DatasetSource, Mixture, diagnose_jsonl, lookup, mix_counts, read_rows
from megatron_rl.rollout.tasks import DatasetTask, PromptStream, TaskError, encode, make_eval_prompts, make_task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VERL = str(FIXTURES / "verl_math.parquet")
TRL = str(FIXTURES / "trl_math.jsonl")
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from megatron_rl.models.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """The tiny checkpoint's tokenizer as `AutoTokenizer` loads it, its chat template taken away (as many base
    models' tokenizers have none)."""
    from megatron_rl.rollout.tasks import load_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(folder)
    tok = load_tokenizer(folder)
    tok.chat_template = None
    return tok


def source(tokenizer, path: str, template: str = TEMPLATE, max_prompt_tokens: int = 256, **keys) -> DatasetSource:
    keys.setdefault("prompt_key", "prompt")
    keys.setdefault("answer_key", "answer")
    return DatasetSource(DatasetConfig(path=path, **keys), tokenizer, max_prompt_tokens, template)


def write_rows(tmp_path, fmt: str, rows: list[dict], name: str = "data"):
    if fmt == "jsonl":
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Records.


@pytest.mark.parametrize("tok", ["tokenizer", "hf_tokenizer"])
def test_a_verl_parquet_with_a_dotted_answer_key(request, tok):
    tokenizer = request.getfixturevalue(tok)
    data = source(tokenizer, VERL, answer_key="reward_model.ground_truth")
    assert len(data) == 8
    record = data.record(3)
    assert record["prompt"] == "system: Put the final answer in \\boxed{}.\nuser: What is 5 + 10?\nassistant:"
    assert record["prompt_ids"] == encode(tokenizer, record["prompt"])
    assert record["answer"] == "15" and record["data_source"] == "arith/add" and record["source"] == f"{VERL}:3"
    assert record["messages"][1] == {"role": "user", "content": "What is 5 + 10?"}
    assert record["row"] == {
        "data_source": "arith/add",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "15"},
        "extra_info": {"split": "train", "index": 3, "question": "5 + 10"},
    }
    assert json.loads(json.dumps(record)) == record  # records travel through Ray and checkpoints as JSON


def test_a_trl_jsonl_keeps_every_other_column(tokenizer):
    data = source(tokenizer, TRL, answer_key="solution", data_source="mult")
    record = data.record(1)
    assert record["prompt"] == "Compute 5 * 5. Answer:" and record["answer"] == "25" and "messages" not in record
    assert record["row"] == {"solution": "25", "level": 1, "topic": "multiplication"}
    assert record["data_source"] == "mult"  # no data_source column: the spec's


def test_lookup_reaches_nested_columns_and_list_items():
    row = {"a": {"b": [{"c": 1}]}, "x.y": 2, "n": None}
    assert lookup(row, "a.b.0.c") == 1 and lookup(row, "x.y") == 2 and lookup(row, "n") is None
    assert lookup(row, "a.z") is not None and lookup(row, "a.z") is lookup(row, "a.b.7")  # both missing


def test_chat_prompts_need_a_template(tokenizer, hf_tokenizer, tmp_path):
    for tok in (tokenizer, hf_tokenizer):
        with pytest.raises(TaskError, match=f"{re.escape(VERL)} row 0, column 'prompt': the prompt is chat messages"):
            source(tok, VERL, template="", answer_key="reward_model.ground_truth")
    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE)
    cfg = TaskConfig(name="dataset", path=VERL, answer_key="reward_model.ground_truth", chat_template=str(file))
    assert make_task(cfg, tokenizer).sources[0].record(0)["prompt"].endswith("assistant:")
    with pytest.raises(TaskError, match="task.chat_template='nope.jinja': neither a Jinja template nor"):
        make_task(cfg.model_copy(update={"chat_template": "nope.jinja"}), tokenizer)


BAD_ROWS = [
    {"question": "What is 1 + 1?", "solution": "2"},
    {"question": "", "solution": "3"},  # row 1: empty prompt
    {"question": "What is 2 + 2?", "solution": None},  # row 2: missing answer
    {"question": "the " * 40 + "?", "solution": "4"},  # row 3: too long
    {"question": "What is 5 + 5?", "solution": "10"},
    {"solution": "11"},  # row 5: no prompt field
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_bad_rows_are_skipped_and_counted(tmp_path, tokenizer, fmt):
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
    assert task.score("so \\boxed{10}", "10") == 1.0
    assert task.report()["datasets"] == [{"path": str(path), "rows": 6, "usable": 2, "skipped": dict(task.skipped)}]
    from megatron_rl.launcher import skipped_rows_notice  # the launcher's imports (Ray) are not the data layer's

    assert skipped_rows_notice(task) == f"dataset rows skipped: {task.skip_summary()}"  # said on the console
    assert skipped_rows_notice(make_task(TaskConfig(name="count"), tokenizer)) is None


def test_no_answer_key_means_rows_without_one(tokenizer):
    data = source(tokenizer, TRL, answer_key="")
    assert len(data) == 8 and data.record(0)["answer"] is None


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line naming file, row and column.


def _error(tokenizer, path, **keys) -> str:
    with pytest.raises(TaskError) as info:
        source(tokenizer, str(path), **keys)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_input_errors(tmp_path, tokenizer):
    def file(name: str, content: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(content)
        return path

    missing = tmp_path / "none.jsonl"
    assert _error(tokenizer, missing) == f"dataset file '{missing}' does not exist"
    bad = file("bad.jsonl", b'{"prompt": "a", "answer": "1"}\n\n{not json\n')
    assert _error(tokenizer, bad) == (
        f"{bad} line 3 (row 1), column 2: not valid JSON: Expecting property name enclosed in double quotes"
    )
    latin = file("latin1.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9?", "answer": "1"}\n')
    assert _error(tokenizer, latin) == (
        f"{latin} line 2 (row 1), column 16: not UTF-8 text (byte 0xe9); save the file as UTF-8"
    )
    for name, content in (("empty.jsonl", b""), ("blank.jsonl", b"\n  \n"), ("empty.parquet", b"")):
        path = file(name, content)
        assert _error(tokenizer, path) == f"{path}: the file is empty (no rows)"
    # datasets 5 reads a column of mixed JSON types (older ones refuse it); where it refuses, this names the line.
    mixed = file("mixed.jsonl", b'{"prompt": "a", "answer": null}\n{"prompt": "b", "answer": "1"}\n{"answer": 2}\n')
    assert (
        diagnose_jsonl(str(mixed)) == f"{mixed} line 3 (row 2), column 'answer': a number here but a string in line 2"
    )
    listed = file("list.jsonl", b'{"prompt": "a", "answer": "1"}\n[1, 2]\n')
    assert _error(tokenizer, listed) == f"{listed} line 2 (row 1), column 1: expected a JSON object, got list"
    broken = file("broken.parquet", b"PAR1 this is not parquet")
    assert _error(tokenizer, broken).startswith(f"{broken}: cannot read as parquet: ")
    other = file("data.csv", b"a,b\n")
    assert _error(tokenizer, other) == f"{other}: cannot tell the format from '.csv'; use a .jsonl or .parquet file"


def test_missing_columns_and_misspelt_dotted_keys(tokenizer):
    assert _error(tokenizer, VERL, answer_key="answer") == (
        f"{VERL}: no column 'answer' (columns: data_source, prompt, ability, reward_model, extra_info); set "
        "task.answer_key (dots reach nested columns, as in reward_model.ground_truth)"
    )
    assert _error(tokenizer, VERL, answer_key="reward_model.ground_truht") == (
        f"{VERL} row 0, column 'reward_model': no 'reward_model.ground_truht' in any row (row 0's 'reward_model' "
        "holds keys: style, ground_truth); set task.answer_key"
    )
    assert "no column 'question'" in _error(tokenizer, TRL, prompt_key="question", answer_key="solution")


def test_no_usable_rows_says_why(tmp_path, tokenizer):
    path = write_rows(tmp_path, "jsonl", BAD_ROWS)
    message = _error(tokenizer, path, prompt_key="question", answer_key="solution", max_prompt_tokens=2)
    assert re.fullmatch(rf"{re.escape(str(path))}: no usable rows out of 6 \(skipped 6 rows .*row 0: .*\)", message)


def test_task_config_refuses_contradictions():
    from megatron_rl.config import ConfigError, load_config

    for overrides, error in [
        (["task.name=jsonl"], "task.name=jsonl needs task.path or task.datasets"),
        (["task.path=a.jsonl"], "task.name=count is a built-in task"),
        (["task.name=dataset", "task.path=a", "task.datasets=[{path: b}]"], "task.path and task.datasets both set"),
        (["task.reward=math", "task.rewards=[{fn: math}]"], "task.reward and task.rewards both set"),
        (["task.name=dataset", "task.datasets=[{path: a, weight: 0}]"], "task.datasets.0.weight: "),
        (["task.name=nope"], "task.name: must be one of 'count', 'copy', 'jsonl', 'parquet' or 'dataset'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(error)):
            load_config(None, overrides)


# ---------------------------------------------------------------------------------------------------------------
# Folders and Hugging Face names.


def test_a_folder_written_by_save_to_disk(tmp_path, tokenizer):
    rows = datasets.Dataset.from_list([{"prompt": f"q{i}", "answer": str(i)} for i in range(3)])
    rows.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": rows, "test": rows.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert len(source(tokenizer, str(tmp_path / "one"))) == 3
    assert len(source(tokenizer, str(tmp_path / "dict"), split="test")) == 1
    with pytest.raises(TaskError, match=r"no split 'dev' \(splits: \['test', 'train'\]\)"):
        source(tokenizer, str(tmp_path / "dict"), split="dev")


def cache_as_hub_dataset(cache: Path, repo: str, rows: list[dict]) -> None:
    """Lay `rows` out in a datasets cache as `load_dataset(repo)` leaves a Hub dataset there."""
    from datasets.packaged_modules.json.json import Json

    data = cache / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    name = repo.split("/")[-1]
    builder = Json(cache_dir=str(cache / "build"), dataset_name=name, config_name="default", data_files=str(data))
    builder.download_and_prepare()
    target = cache / repo.replace("/", "___") / "default" / "0.0.0" / "0123abcd"
    shutil.copytree(builder.cache_dir, target)


def test_a_hugging_face_name_loads_offline_from_the_local_cache(tmp_path, tokenizer, monkeypatch):
    cache_as_hub_dataset(tmp_path, "megatron-rl/tiny_math", [{"prompt": "2+2?", "answer": "4"}] * 3)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1 sets it
    data = source(tokenizer, "megatron-rl/tiny_math")
    assert len(data) == 3 and data.record(0)["answer"] == "4"
    assert data.record(0)["data_source"] == "megatron-rl/tiny_math"
    message = _error(tokenizer, "megatron-rl/not_cached")
    assert message.startswith(
        f"dataset 'megatron-rl/not_cached': the Hugging Face Hub cannot be reached and the dataset is not in the "
        f"local cache ({tmp_path}): "
    )
    assert message.endswith("download it where there is network (the cache is then used offline, "
                            "HF_DATASETS_OFFLINE=1 skips the Hub) or use a local file")  # fmt: skip


def test_read_rows_reads_files_as_datasets():
    rows = read_rows(DatasetConfig(path=TRL))
    assert len(rows) == 8 and rows.column_names == ["prompt", "solution", "level", "topic"]


# ---------------------------------------------------------------------------------------------------------------
# Mixing and the data position.


def test_mix_counts_follow_the_weights_exactly():
    assert mix_counts([8, 8], [3.0, 1.0]) == [12, 4]
    assert mix_counts([5, 3, 2], [1, 1, 1]) == [4, 3, 3]
    assert sum(mix_counts([7, 11, 1], [0.3, 0.3, 0.4])) == 19


def test_a_mixture_is_deterministic_by_seed_and_continues_each_dataset():
    mix = Mixture([4, 6], [1.0, 1.0], seed=3)
    epoch0, epoch1 = mix.order(0), mix.order(1)
    assert epoch0 == Mixture([4, 6], [1.0, 1.0], seed=3).order(0)
    assert epoch0 != Mixture([4, 6], [1.0, 1.0], seed=4).order(0)
    assert [s for s, _ in epoch0].count(0) == 5 and [s for s, _ in epoch0].count(1) == 5
    # Dataset 0 has 4 rows and 5 slots per epoch: every row within its first pass, then the next pass.
    visits = collections.Counter(row for s, row in epoch0 + epoch1 if s == 0)
    assert sorted(visits) == [0, 1, 2, 3] and set(visits.values()) == {2, 3}  # 10 slots: 2.5 passes
    ordered = Mixture([2, 2], [1.0, 1.0], seed=0, shuffle=False).order(0)
    assert ordered == [(0, 0), (1, 0), (0, 1), (1, 1)]  # interleaved by weight in file order


def test_mixed_datasets_resume_at_exactly_the_same_prompts(tmp_path, tokenizer):
    cfg = TaskConfig(
        name="dataset",
        answer_key="reward_model.ground_truth",
        chat_template=TEMPLATE,
        seed=5,
        datasets=[{"path": VERL, "weight": 3.0}, {"path": TRL, "answer_key": "solution"}],
    )
    task = make_task(cfg, tokenizer, seed=cfg.seed)
    assert task.mixture.counts == [12, 4]
    stream = PromptStream(task, epochs=3)
    for _ in range(21):  # into the second epoch
        stream.next()
    state = json.loads(json.dumps(stream.state_dict()))
    rest = [stream.next() for _ in range(30)]
    assert rest[-3] is None and rest[-4] is not None  # 3 epochs x 16 prompts
    restored = PromptStream(make_task(cfg, tokenizer, seed=cfg.seed), epochs=3)
    restored.load_state_dict(state)
    assert [restored.next() for _ in range(30)] == rest
    sources = [r["source"].rsplit(":", 1)[0] for _, r in rest[:-3]]
    assert abs(sources.count(VERL) / len(sources) - 0.75) < 0.1


def test_one_dataset_keeps_its_order_and_epochs(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    spec = DatasetConfig(path=str(write_rows(tmp_path, "jsonl", rows)))
    task = DatasetTask([spec], tokenizer, seed=7)
    stream = PromptStream(task, epochs=2)
    got = [stream.next() for _ in range(7)]
    assert [i for i, _ in got] == list(range(7))
    first = [p["source"] for _, p in got[:5]]
    assert sorted(first) == sorted({p["source"] for p in task.prompts(0)})  # each row once per epoch
    assert first != [p["source"] for p in task.prompts(1)]  # reshuffled per epoch
    assert [p["source"] for p in DatasetTask([spec], tokenizer, seed=7, shuffle=False).prompts(0)] == [
        f"{spec.path}:{i}" for i in range(5)
    ]


# ---------------------------------------------------------------------------------------------------------------
# Validation prompts.


def test_eval_prompts_come_in_file_order_in_the_training_format(tokenizer):
    cfg = TaskConfig(
        name="dataset",
        path=TRL,
        answer_key="solution",
        chat_template=TEMPLATE,
        eval_datasets=[
            {"path": VERL, "answer_key": "reward_model.ground_truth"},
            {"path": TRL, "answer_key": "solution"},
        ],
    )
    records = make_eval_prompts(cfg, tokenizer, limit=3)
    assert [r["source"] for r in records] == [f"{VERL}:{i}" for i in range(3)] + [f"{TRL}:{i}" for i in range(3)]
    assert records[0]["answer"] == "3" and records[3]["row"]["topic"] == "multiplication"
    assert len(make_eval_prompts(cfg, tokenizer)) == 16
    assert make_eval_prompts(cfg.model_copy(update={"eval_datasets": []}), tokenizer) == []
    task = make_task(cfg, tokenizer)
    assert task.score("\\boxed{3}", records[0]["answer"], record=records[0]) == 1.0


def test_the_configs_of_docs_data_md_load_and_score(tmp_path, tokenizer, monkeypatch):
    import yaml

    from megatron_rl.config.loader import validate

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    (python,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (tmp_path / "my_rewards.py").write_text(python)
    configs = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]
    assert len(configs) == 4
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    for data in configs:
        for reward in data["task"].get("rewards", []):
            reward["fn"] = reward["fn"].replace("my_rewards.py", str(tmp_path / "my_rewards.py"))
        if "reward" in data["task"]:
            data["task"]["reward"] = data["task"]["reward"].replace("my_rewards.py", str(tmp_path / "my_rewards.py"))
        cfg = validate(data).task
        task = make_task(cfg, tokenizer)
        task.set_response_limit(8)
        _, record = PromptStream(task).next()
        assert task.score(f"so \\boxed{{{record['answer']}}}", record["answer"], record=record) > 0.9, cfg
        assert len(make_eval_prompts(cfg, tokenizer)) == (8 if cfg.eval_datasets else 0)


def test_a_folder_of_data_files_with_a_broken_jsonl_names_the_file_and_line(tmp_path, tokenizer):
    """datasets said only "DatasetGenerationError: An error occurred while generating the dataset"."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    (folder / "b.jsonl").write_text('{"prompt": "What is 2 + 2?", "answer": "4"}\n{"prompt": "3 + 3", "ans\n')
    where = f"dataset '{folder}': cannot load it: {folder / 'b.jsonl'} line 2 \\(row 1\\), column 25: not valid JSON"
    with pytest.raises(TaskError, match=where):
        make_task(TaskConfig(name="dataset", path=str(folder)), tokenizer)


def test_a_tokenizer_that_cannot_load_or_holds_no_vocabulary_is_refused_naming_the_folder(tmp_path):
    from megatron_rl.models.base import CheckpointError
    from megatron_rl.rollout.tasks import load_tokenizer

    save_tokenizer(tmp_path)
    assert len(load_tokenizer(tmp_path)) > 2
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0",\n')  # cut short
    with pytest.raises(CheckpointError, match=f"{re.escape(str(tmp_path))}: cannot load its tokenizer: .*Error"):
        load_tokenizer(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tmp_path / "tokenizer_config.json", empty)  # names a tokenizer class, but no vocabulary
    with pytest.raises(CheckpointError, match=r"empty: cannot load its tokenizer: ValueError: Couldn't instantiate"):
        load_tokenizer(empty)  # (no tokenizer file at all gives a tokenizer of 1 token: tests/e2e/test_data_errors.py)


def test_a_file_in_another_format_than_the_config_forces_is_refused_saying_so(tokenizer, tmp_path):
    forced = r"read as {} \(task.name or the dataset's format says so; format auto goes by the suffix\)"
    with pytest.raises(TaskError, match=f"{re.escape(VERL)}: a Parquet file, {forced.format('jsonl')}"):
        make_task(TaskConfig(name="jsonl", path=VERL, answer_key="reward_model.ground_truth"), tokenizer)
    with pytest.raises(TaskError, match=f"{re.escape(TRL)}: not a Parquet file, {forced.format('parquet')}"):
        make_task(TaskConfig(name="parquet", path=TRL, answer_key="solution"), tokenizer)
    with pytest.raises(TaskError, match=f"{re.escape(TRL)}: a file, read as hf .* a Hugging Face name"):
        make_task(
            TaskConfig(name="dataset", datasets=[{"path": TRL, "format": "hf"}], answer_key="solution"), tokenizer
        )
    assert len(make_task(TaskConfig(name="jsonl", path=TRL, answer_key="solution"), tokenizer)) > 0


def test_a_dataset_whose_weight_gives_it_no_prompt_is_refused(tokenizer):
    datasets = [{"path": TRL, "answer_key": "solution"}, {"path": TRL, "answer_key": "solution", "weight": 1e-6}]
    with pytest.raises(
        TaskError, match=r"task.datasets\[1\] \(.*trl_math.jsonl\): its weight 1e-06 gives it no prompt"
    ):
        make_task(TaskConfig(name="dataset", datasets=datasets), tokenizer)
