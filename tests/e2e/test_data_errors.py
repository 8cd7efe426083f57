"""`megatron-rl train` on bad data and bad reward modules: exit code 2 and one line on stderr naming the file,
row and column, no traceback, nothing of the run folder's earlier content lost (the errors come before Ray
starts). A reward that exits on every call stops a run with such a line too: tests/unit/test_driver.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from megatron_rl.models.tiny import make_tiny

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
VERL = str(REPO / "tests" / "fixtures" / "verl_math.parquet")
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
PREFIX = "megatron-rl train: error: "


def _base(tmp_path: Path, case: str) -> list[str]:
    return [
        "configs/quickstart.yaml", f"output_dir={tmp_path / case}", f"model.hf_path={tmp_path / 'tiny'}",
        "task.name=dataset",
    ]  # fmt: skip


def _file(tmp_path: Path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def test_a_bad_json_row_exits_2_with_one_line_naming_file_line_row_and_column(tmp_path):
    bad = _file(tmp_path, "bad.jsonl", b'{"prompt": "What is 1 + 1?", "answer": "2"}\n{not json\n')
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", *_base(tmp_path, "run"), f"task.path={bad}"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        f"{PREFIX}{bad} line 2 (row 1), column 2: not valid JSON: Expecting property name enclosed in double quotes"
    ], result.stderr[-3000:]


def test_every_bad_input_is_one_line_naming_where(tmp_path):
    latin = _file(tmp_path, "latin1.jsonl", b'{"prompt": "caf\xe9", "answer": "1"}\n')
    empty = _file(tmp_path, "empty.jsonl", b"")
    syntax = _file(tmp_path, "syntax_reward.py", b"def compute_score(data_source, solution_str:\n")
    exits = _file(tmp_path, "exit_reward.py", b"import sys\nsys.exit(4)\n")
    template = _file(tmp_path, "chat.jinja", TEMPLATE.encode())
    missing = str(tmp_path / "none.jsonl")
    no_answer = _file(tmp_path, "no_answer.jsonl", b'{"prompt": "What is 2 + 2?"}\n')
    verl = [f"task.path={VERL}", f"task.chat_template={template}"]
    broken = make_tiny("qwen3_moe", tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    untokenized = make_tiny("qwen3_moe", tmp_path / "untokenized")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (untokenized / name).unlink()
    small_vocab = make_tiny("qwen3_moe", tmp_path / "small_vocab")
    config = json.loads((small_vocab / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    cases = {
        "missing": ([f"task.path={missing}"], f"dataset file '{missing}' does not exist"),
        "utf8": (
            [f"task.path={latin}"],
            f"{latin} line 1 (row 0), column 16: not UTF-8 text (byte 0xe9); save the file as UTF-8",
        ),
        "empty": ([f"task.path={empty}"], f"{empty}: the file is empty (no rows)"),
        "column": (
            verl,
            f"{VERL}: no column 'answer' (columns: data_source, prompt, ability, reward_model, extra_info); set "
            "task.answer_key (dots reach nested columns, as in reward_model.ground_truth)",
        ),
        "dotted": (
            [*verl, "task.answer_key=reward_model.groundtruth"],
            f"{VERL} row 0, column 'reward_model': no 'reward_model.groundtruth' in any row (row 0's "
            "'reward_model' holds keys: style, ground_truth); set task.answer_key",
        ),
        "syntax": (
            [*verl, "task.answer_key=reward_model.ground_truth", f"task.reward={syntax}:compute_score"],
            f"reward '{syntax}:compute_score': cannot import '{syntax}': SyntaxError: '(' was never closed "
            f"({syntax} line 1, column 18)",
        ),
        "import_exit": (
            [*verl, "task.answer_key=reward_model.ground_truth", f"task.reward={exits}:f"],
            f"reward '{exits}:f': cannot import '{exits}': SystemExit: 4 ({exits} line 2)",
        ),
        "no_module": (
            [*verl, "task.answer_key=reward_model.ground_truth", "task.reward=no_such_rewards:compute_score"],
            "reward 'no_such_rewards:compute_score': cannot import 'no_such_rewards': ModuleNotFoundError: No "
            "module named 'no_such_rewards'",
        ),
        # Checked before anything starts too (they failed after Ray, the engines and torchrun had started, or not
        # at all): the tiny model exists by now, made by the first case.
        "one_sample": (
            [*verl, "task.answer_key=reward_model.ground_truth", "rollout.samples_per_prompt=1"],
            "algorithm.advantage=grpo compares each response with the others of its prompt's group: with "
            "rollout.samples_per_prompt=1 every advantage is 0 and nothing is learned; set it to 2 or more (the "
            "quickstart's is 8)",
        ),
        "family": (
            [*verl, "task.answer_key=reward_model.ground_truth", "model.family=mixtral"],
            f"model.family=mixtral, but {tmp_path / 'tiny' / 'config.json'} holds a qwen3_moe model (set "
            "model.family=qwen3_moe, or null to take it from config.json)",
        ),
        "missing_tensor": (  # found once the engines were up (~35 s)
            [*verl, "task.answer_key=reward_model.ground_truth", f"model.hf_path={broken}", "model.make_tiny=false"],
            f"{broken}: 1 missing tensor(s): model.layers.0.self_attn.k_proj.weight",
        ),
        "layout": (
            [*verl, "task.answer_key=reward_model.ground_truth", "trainer.parallel.ep=3"],
            "trainer.parallel.ep=3: the model's experts (8) is not divisible by 3",
        ),
        "no_tokenizer": (  # transformers gave a tokenizer of one token: every prompt encoded as nothing
            [
                *verl,
                "task.answer_key=reward_model.ground_truth",
                f"model.hf_path={untokenized}",
                "model.make_tiny=false",
            ],
            f"{untokenized}: its tokenizer holds 1 token(s): are tokenizer.json / tokenizer_config.json (or the "
            "vocabulary files they name) missing?",
        ),
        "vocab": (
            [
                *verl,
                "task.answer_key=reward_model.ground_truth",
                f"model.hf_path={small_vocab}",
                "model.make_tiny=false",
            ],
            f"{small_vocab}: its tokenizer has 512 tokens, config.json's vocab_size is 256: the tokens past it have no "
            "embedding",
        ),
        "eval_column": (  # was found once Ray, the engines and torchrun were up; ignored without eval.interval
            [*verl, "task.answer_key=reward_model.ground_truth", f"task.eval_datasets=[{{path: {no_answer}}}]"],
            f"{no_answer}: no column 'reward_model.ground_truth' (columns: prompt); set task.answer_key (dots reach "
            "nested columns, as in reward_model.ground_truth)",
        ),
        "eval_nothing": (
            [*verl, "task.answer_key=reward_model.ground_truth", "eval.interval=1"],
            "eval.interval is set but there is nothing to evaluate on: give task.eval_datasets (see docs/data.md)",
        ),
        "save_dir": (  # failed at the run's first save: with the default interval, after its last step
            [*verl, "task.answer_key=reward_model.ground_truth", f"checkpoint.save_dir={template}"],
            f"checkpoint.save_dir='{template}' cannot hold checkpoints: FileExistsError: File exists ({template})",
        ),
        "overlong": (  # failed once the engines and the trainer were up
            [*verl, "task.answer_key=reward_model.ground_truth", "task.overlong_penalty.buffer_tokens=100"],
            "task.overlong_penalty: overlong penalty: buffer_tokens=100 must be in 1..max_tokens=8",
        ),
    }
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([_base(tmp_path, name) + args for name, (args, _) in cases.items()]))
    cmd = [sys.executable, "-m", "tests.support.train_errors", str(spec)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    for (name, (_, expected)), outcome in zip(cases.items(), outcomes):
        lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
        assert outcome["code"] == 2 and lines == [PREFIX + expected], (name, outcome)
        assert not (tmp_path / name / "quickstart" / "metrics.jsonl").exists()
    assert not re.search("Traceback", result.stdout + result.stderr)
