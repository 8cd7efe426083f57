"""A real run on real-workload data: `megatron-rl train` for two steps on the tiny model, its prompts a mix of a
verl-shaped parquet (chat prompts, `reward_model.ground_truth`, `data_source`, `extra_info`) and a TRL-style
jsonl, rewarded by a verl `compute_score` and a TRL batch function from a reward file (plus a third that calls
`sys.exit` once), all three in reward processes. Each reward writes what it received to a file that the test
reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.metrics.logger import read_metrics

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
VERL = str(REPO / "tests" / "fixtures" / "verl_math.parquet")
TRL = str(REPO / "tests" / "fixtures" / "trl_math.jsonl")
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
REWARDS = """
import json, os, sys

LOG = {log!r}


def _write(kind, entry):
    with open(LOG, "a") as f:
        f.write(json.dumps({{"kind": kind, "pid": os.getpid(), **entry}}) + "\\n")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _write("verl", {{"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info}})
    return {{"score": 1.0 if str(ground_truth) in solution_str else 0.0, "length": len(solution_str)}}


def trl_reward(prompts, completions, completion_ids, **kwargs):
    columns = {{k: v for k, v in kwargs.items() if k != "trainer_state"}}
    _write("trl", {{"prompts": prompts, "completions": completions, "columns": columns, "ids": completion_ids}})
    return [0.1 * len(ids) for ids in completion_ids]


def exits_once(response, answer, sample):
    try:  # once across the reward processes: the first to create the marker
        os.close(os.open(LOG + ".exited", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return 0.0
    sys.exit("reward gave up")
"""


def test_two_steps_on_a_verl_parquet_and_a_trl_jsonl_with_verl_and_trl_rewards(tmp_path):
    log = tmp_path / "received.jsonl"
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(REWARDS.format(log=str(log)))
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    datasets = (
        f"[{{path: {VERL}, answer_key: reward_model.ground_truth, weight: 1}}, "
        f"{{path: {TRL}, answer_key: solution, data_source: trl_math}}]"
    )
    fns = f"[{{fn: '{rewards}:compute_score', name: verl}}, {{fn: '{rewards}:trl_reward', name: trl, weight: 0.5}}, "
    fns += f"{{fn: '{rewards}:exits_once', name: exits}}]"
    cmd = [
        sys.executable, "-m", "megatron_rl.cli", "train", "configs/quickstart.yaml", "steps=2",
        f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "task.name=dataset", f"task.datasets={datasets}",
        f"task.rewards={fns}", f"task.chat_template={template}", "task.overlong_penalty.buffer_tokens=4",
        "task.reward_isolation=process",  # the file's functions loaded again in the reward processes, run there
    ]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = launcher.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.communicate()
        raise
    assert launcher.returncode == 0, stderr[-4000:]
    run_dir = tmp_path / "quickstart"
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    received = [json.loads(line) for line in log.read_text().splitlines()]

    pids = {r["pid"] for r in received}
    assert launcher.pid not in pids and 0 < len(pids) <= 2  # the driver's reward processes (two), none killed
    verl = [r for r in received if r["kind"] == "verl"]
    from_parquet = [r for r in verl if r["data_source"] == "arith/add"]
    from_jsonl = [r for r in verl if r["data_source"] == "trl_math"]
    assert from_parquet and from_jsonl and len(from_parquet) + len(from_jsonl) == len(verl)
    for r in from_parquet:  # the ground truth and extra_info of the row the response answered
        a, b = r["extra_info"]["question"].split(" + ")
        assert r["ground_truth"] == str(int(a) + int(b)) and r["extra_info"]["split"] == "train"
    assert all(r["extra_info"] == {} for r in from_jsonl)  # no extra_info column there

    trl = [r for r in received if r["kind"] == "trl"]
    assert len(trl) >= 16 and len(verl) >= 8 * 16  # 2 steps of 8 groups: one call per group, one per sample
    for r in trl:
        columns = r["columns"]
        assert all(len(values) == 8 for values in columns.values()) and len(r["completions"]) == 8
        if "solution" in columns:  # a jsonl prompt: its other columns, as lists
            assert set(columns) == {"solution", "level", "topic"} and columns["topic"] == ["multiplication"] * 8
            a, b = r["prompts"][0].removeprefix("Compute ").removesuffix(". Answer:").split(" * ")
            assert columns["solution"] == [str(int(a) * int(b))] * 8
            assert all(isinstance(c, str) for c in r["completions"])
        else:  # a parquet prompt: chat messages, and assistant messages as completions
            assert set(columns) == {"data_source", "ability", "reward_model", "extra_info"}
            assert r["prompts"][0][1]["role"] == "user" and r["completions"][0][0]["role"] == "assistant"
        assert all(1 <= len(ids) <= 8 for ids in r["ids"])

    task = summary["task"]
    assert task["reward_failures"] == 1, task  # the sys.exit: one failed sample, its group dropped, the run went on
    error = task["recent"][0]["error"]
    assert error.startswith(f"reward '{rewards}:exits_once' raised SystemExit: reward gave up (prompt ")
    assert [d["usable"] for d in task["datasets"]] == [8, 8]
    assert summary["accounting"]["consumed"] == 2 * 8
