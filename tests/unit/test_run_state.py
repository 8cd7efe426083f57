"""Whole-run checkpoint bookkeeping, run control and per-request seeds: pure logic, no processes."""

from __future__ import annotations

import json
import random

import pytest
import torch

from megatron_rl.rollout.control import RunControl
from megatron_rl.rollout.driver import request_seed
from megatron_rl.run_state import (
    ResumeError,
    is_due,
    latest_checkpoint,
    mark_latest,
    read_run_state,
    refuse_used_save_dir,
    step_dir,
    truncate_metrics,
    write_run_state,
)
from megatron_rl.trainer.checkpoint import load_rng, save_rng


def test_checkpoint_schedule():
    due = [s for s in range(1, 11) if is_due(s, 4, 10)]
    assert due == [4, 8, 10]
    assert [s for s in range(1, 6) if is_due(s, 0, 5)] == [5]


def test_latest_is_only_what_was_marked(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    first = step_dir(tmp_path, 2)
    first.mkdir()
    write_run_state(first, 2, {"format": 1, "groups": []})
    assert latest_checkpoint(tmp_path) is None  # written but not yet marked: a crash here keeps the old one
    mark_latest(tmp_path, first)
    assert latest_checkpoint(tmp_path) == first
    state = read_run_state(first)
    assert state["step"] == 2 and state["version"] == 2 and state["buffer"] == {"format": 1, "groups": []}


def test_latest_pointing_at_a_deleted_checkpoint_is_named(tmp_path):
    (tmp_path / "latest").write_text("step_00000007\n")
    with pytest.raises(ResumeError, match="step_00000007"):
        latest_checkpoint(tmp_path)


def test_run_state_of_another_format_is_refused(tmp_path):
    (tmp_path / "run_state.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ResumeError, match="format 99"):
        read_run_state(tmp_path)


def test_rng_round_trip(tmp_path):
    torch.manual_seed(3)
    random.seed(5)
    save_rng(tmp_path, rank=1)
    expected = (torch.rand(4), random.random())
    torch.manual_seed(99)
    random.seed(99)
    assert load_rng(tmp_path, rank=1)
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
    assert not load_rng(tmp_path, rank=3)  # a rank the saving layout did not have


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 6)))
    assert truncate_metrics(path, 3) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == 0


def test_run_control_roster_epochs_and_trainer_reports():
    control = RunControl([("engine-0", 1), ("engine-1", 2)])
    assert control.roster()["epoch"] == 0
    control.engine_down("engine-1", "ActorDiedError")
    assert control.roster()["down"] == {"engine-1": "ActorDiedError"}
    assert control.engine_restarted("engine-1") == 1
    roster = control.roster()
    assert roster["down"] == {} and roster["restarts"] == {"engine-1": 1}
    assert roster["engines"] == [["engine-0", 1], ["engine-1", 2]]
    control.report_trainer("running", 4)
    control.report_failure("rank 0: TimeoutError: no batch")
    status = control.trainer_status()
    assert status["state"] == "failed" and status["step"] == 4 and "no batch" in status["message"]
    assert status["age_s"] >= 0
    with pytest.raises(ValueError, match="state='dead'"):
        control.report_trainer("dead", 1)


def test_request_seeds_are_fixed_and_distinct():
    seeds = {request_seed(1234, p, s) for p in range(200) for s in range(16)}
    assert len(seeds) == 200 * 16
    assert request_seed(1234, 7, 3) == request_seed(1234, 7, 3)
    assert request_seed(1234, 7, 3) != request_seed(1235, 7, 3)
    assert all(0 <= s < 1 << 63 for s in seeds)


def test_truncate_metrics_drops_a_torn_last_line_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 4)) + '{"step": 4, "lo')
    with caplog.at_level("WARNING", logger="megatron_rl.run_state"):
        assert truncate_metrics(path, 3) == 3
    assert "unparseable last line 4" in caplog.text
    assert path.read_text() == "".join(json.dumps({"step": s}) + "\n" for s in range(1, 4))


def test_truncate_metrics_refuses_an_unparseable_line_before_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ResumeError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        truncate_metrics(path, 3)
    assert truncate_metrics(path, 0) == 0 and path.read_text() == ""  # a fresh run keeps nothing, unread


def test_refuse_used_save_dir_names_the_folder(tmp_path):
    refuse_used_save_dir("")
    refuse_used_save_dir(tmp_path / "absent")
    mark_latest(tmp_path, step_dir(tmp_path, 2))
    with pytest.raises(ResumeError, match=r"already holds a run's checkpoints.*pass --resume"):
        refuse_used_save_dir(tmp_path)


def test_a_fresh_run_refuses_a_run_folder_in_use_and_a_failed_start_changes_nothing(tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.launcher import run_training
    from megatron_rl.rollout.tasks import TaskError
    from megatron_rl.run_state import refuse_used_run_dir

    run_dir = tmp_path / "quickstart"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.yaml").write_text("steps: 1\n")
    refuse_used_run_dir(tmp_path / "other", resume=False, overwrite=False)  # nothing there: fine
    refuse_used_run_dir(run_dir, resume=True, overwrite=False)  # continuing it
    with pytest.raises(ResumeError, match="holds an earlier run .*--resume .*--overwrite"):
        refuse_used_run_dir(run_dir, resume=False, overwrite=False)
    cfg = load_config(
        "configs/quickstart.yaml",
        [f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "task.name=jsonl", f"task.path={tmp_path}/no.jsonl"],
    )
    with pytest.raises(ResumeError):
        run_training(cfg)
    with pytest.raises(TaskError, match="no.jsonl"):
        run_training(cfg, overwrite=True)  # the dataset is missing: start-up fails before the folder changes
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (run_dir / "config.yaml").read_text() == "steps: 1\n"
