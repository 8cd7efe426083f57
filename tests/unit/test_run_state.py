"""Whole-run checkpoint bookkeeping, run control and per-request seeds: pure logic, no processes."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from megatron_rl.rollout.control import RunControl
from megatron_rl.rollout.driver import request_seed
from megatron_rl.run_state import (
    ResumeError,
    check_save_dir,
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
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "run_state.json").write_text("{}")
    (tmp_path / "latest").write_text("final\n")
    with pytest.raises(ResumeError, match=r"latest names 'final', not a step_<N> folder; .* holds no other"):
        latest_checkpoint(tmp_path)


def test_run_state_of_another_format_is_refused(tmp_path):
    (tmp_path / "run_state.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ResumeError, match="format 99"):
        read_run_state(tmp_path)


@pytest.mark.parametrize(
    "state, says",
    [
        ([1, 2], "a run state is a JSON object, not a list"),
        ({"format": 1, "buffer": None}, "'step' must be a step number and 'buffer' an object or null \\(got None"),
        ({"format": 1, "step": "two", "buffer": None}, "got 'two' and a NoneType"),
        ({"format": 1, "step": 2, "buffer": [3]}, "got 2 and a list"),
    ],
)
def test_a_malformed_run_state_is_refused_naming_the_file(tmp_path, state, says):
    folder = step_dir(tmp_path, 2)
    folder.mkdir()
    (folder / "run_state.json").write_text(json.dumps(state))
    with pytest.raises(ResumeError, match=f"{re.escape(str(folder / 'run_state.json'))}: .*{says}"):
        read_run_state(folder)


def test_a_save_dir_that_cannot_hold_checkpoints_is_refused_at_start(tmp_path):
    check_save_dir("")
    check_save_dir(tmp_path / "new" / "deeper")  # made, and writable
    assert (tmp_path / "new" / "deeper").is_dir() and not list((tmp_path / "new" / "deeper").iterdir())
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ResumeError, match=r"checkpoint.save_dir='.*a_file' cannot hold checkpoints: FileExistsError"):
        check_save_dir(tmp_path / "a_file")
    with pytest.raises(ResumeError, match=r"cannot hold checkpoints: NotADirectoryError"):
        check_save_dir(tmp_path / "a_file" / "below")


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
    assert truncate_metrics(path, 1) == 1  # a second resume, from an earlier step: the cut records are kept aside
    rewound = [json.loads(line) for line in (tmp_path / "metrics.rewound.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rewound_to"]) for r in rewound] == [(4, 3), (5, 3), (2, 1), (3, 1)]
    assert rewound[0]["loss"] == 0.4
    assert truncate_metrics(path, 0) == 0 and not (tmp_path / "metrics.rewound.jsonl").exists()  # a fresh run
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
        [
            f"output_dir={tmp_path}",
            f"model.hf_path={tmp_path}/tiny",
            "task.name=jsonl",
            f"task.path={tmp_path}/no.jsonl",
        ],
    )
    with pytest.raises(ResumeError):
        run_training(cfg)
    with pytest.raises(TaskError, match="no.jsonl"):
        run_training(cfg, overwrite=True)  # the dataset is missing: start-up fails before the folder changes
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (run_dir / "config.yaml").read_text() == "steps: 1\n"


# ---------------------------------------------------------------------------------------------------------------
# Staged, durable, pruned checkpoints (one process: the ranks' agreement degenerates to this process's own).


def _trainer_part(files: dict[str, bytes]):
    """A stand-in for `Learner.save`: writes these files into the folder it is given."""

    def write(folder):
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)

    return write


def test_checkpoints_are_staged_committed_and_pruned(tmp_path):
    from megatron_rl.run_state import prune_checkpoints, save_run_checkpoint, staging_dir
    from megatron_rl.trainer.checkpoint import read_checksums

    for step in (2, 4, 6):
        part = _trainer_part({"shard.distcp": b"x" * step, "rng/rank0.pt": b"r"})
        folder = save_run_checkpoint(tmp_path, step, 2, part, lambda n=step: {"n": n})
        assert folder == step_dir(tmp_path, step) and latest_checkpoint(tmp_path) == folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004", "step_00000006"]  # keep_last 2
    assert not staging_dir(tmp_path, 6).exists()
    recorded = read_checksums(step_dir(tmp_path, 6))
    assert sorted(recorded) == ["rng/rank0.pt", "run_state.json", "shard.distcp"]
    assert recorded["shard.distcp"]["bytes"] == 6
    assert read_run_state(step_dir(tmp_path, 6))["buffer"] == {"n": 6}
    assert prune_checkpoints(tmp_path, 0) == []  # 0 keeps every one
    (tmp_path / "latest").write_text("step_00000004\n")  # the one `latest` names is never removed
    assert prune_checkpoints(tmp_path, 1) == [] and step_dir(tmp_path, 4).exists()


def test_resume_step_picks_a_checkpoint_and_errors_name_the_others(tmp_path):
    from megatron_rl.run_state import checkpoint_steps, other_checkpoints, resume_checkpoint, save_run_checkpoint

    assert checkpoint_steps(tmp_path) == [] and resume_checkpoint(tmp_path, 0) is None
    for step in (2, 4, 6):
        save_run_checkpoint(tmp_path, step, 3, _trainer_part({"shard.distcp": b"x"}), lambda: None)
    step_dir(tmp_path, 8).mkdir()  # a folder without a run state is no checkpoint
    assert checkpoint_steps(tmp_path) == [2, 4, 6]
    assert resume_checkpoint(tmp_path, 0) == step_dir(tmp_path, 6)  # 0: the one `latest` names
    assert resume_checkpoint(tmp_path, 4) == step_dir(tmp_path, 4)
    with pytest.raises(ResumeError, match=r"resume_step=8: .*step_00000008 is not a complete.*steps 6, 4, 2: check"):
        resume_checkpoint(tmp_path, 8)
    assert other_checkpoints(tmp_path, step_dir(tmp_path, 6)).endswith(
        "also holds the checkpoints of steps 4, 2: checkpoint.resume_step=<step> resumes from one"
    )
    state = step_dir(tmp_path, 6) / "run_state.json"
    state.write_text(state.read_text().replace("null", "{}"))
    with pytest.raises(ResumeError, match=r"run_state.json: .*truncated or overwritten.*steps 4, 2: checkpoint.res"):
        read_run_state(step_dir(tmp_path, 6))
    state.unlink()
    with pytest.raises(ResumeError, match=r"names .*step_00000006, which has no run_state.json.*steps 4, 2"):
        latest_checkpoint(tmp_path)
    for step in (2, 4):
        (step_dir(tmp_path, step) / "run_state.json").unlink()
    assert other_checkpoints(tmp_path, step_dir(tmp_path, 6)) == f"{tmp_path} holds no other complete checkpoint"


def test_a_resume_from_an_earlier_step_makes_it_latest_and_moves_the_later_folders_aside(tmp_path):
    from megatron_rl.run_state import (
        checkpoint_steps,
        continue_from,
        prune_checkpoints,
        rewound_to,
        save_run_checkpoint,
    )

    for step in (2, 4, 6):
        save_run_checkpoint(tmp_path, step, 0, _trainer_part({"shard.distcp": b"x"}), lambda: None)
    assert continue_from(tmp_path, step_dir(tmp_path, 6)) == []  # the latest: nothing after it
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 6)
    step_dir(tmp_path, 8).mkdir()  # an incomplete later folder goes too: it belongs to the history left
    assert rewound_to(tmp_path) is None  # a plain resume records no rewind
    moved = continue_from(tmp_path, step_dir(tmp_path, 2), rewind=True)
    assert [p.name for p in moved] == ["step_00000004", "step_00000006", "step_00000008"]
    assert all(p.parent.parent == tmp_path / "abandoned" and (p / "shard.distcp").exists() for p in moved[:2])
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2) and checkpoint_steps(tmp_path) == [2]
    assert rewound_to(tmp_path) == 2
    step_dir(tmp_path, 4).mkdir()  # rewound again within the same second: a folder of its own, nothing merged
    again = continue_from(tmp_path, step_dir(tmp_path, 2))
    assert again[0].parent != moved[0].parent and again[0].parent.name.startswith(moved[0].parent.name)
    save_run_checkpoint(tmp_path, 3, 1, _trainer_part({"shard.distcp": b"y"}), lambda: None)
    assert checkpoint_steps(tmp_path) == [3] and all(p.exists() for p in moved)  # pruning never reaches them
    assert prune_checkpoints(tmp_path, 1) == []


def test_a_failed_save_keeps_the_previous_checkpoint_and_says_so(tmp_path):
    from megatron_rl.models.base import CheckpointError
    from megatron_rl.run_state import save_run_checkpoint, staging_dir

    save_run_checkpoint(tmp_path, 2, 3, _trainer_part({"shard.distcp": b"ok"}), lambda: None)

    def full_disk(folder):
        (folder / "shard.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device", str(folder / "shard.distcp"))

    with pytest.raises(CheckpointError) as caught:
        save_run_checkpoint(tmp_path, 4, 3, full_disk, lambda: None)
    message = str(caught.value)
    assert "saving the checkpoint of step 4 failed" in message and "No space left on device" in message
    assert f"the previous checkpoint {step_dir(tmp_path, 2)} is intact and `--resume` continues from it" in message
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)
    assert not step_dir(tmp_path, 4).exists() and not staging_dir(tmp_path, 4).exists()  # its space given back


def test_a_save_killed_midway_leaves_no_step_folder_and_its_leftovers_go_next_time(tmp_path):
    from megatron_rl.run_state import begin_checkpoint, save_run_checkpoint, staging_dir

    save_run_checkpoint(tmp_path, 2, 3, _trainer_part({"shard.distcp": b"ok"}), lambda: None)
    begin_checkpoint(tmp_path, 4)
    (staging_dir(tmp_path, 4) / "stale.distcp").write_bytes(b"from a save that was killed")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2) and not step_dir(tmp_path, 4).exists()
    folder = save_run_checkpoint(tmp_path, 4, 3, _trainer_part({"shard.distcp": b"new"}), lambda: None)
    assert sorted(p.name for p in folder.iterdir()) == ["checksums.json", "run_state.json", "shard.distcp"]


def test_a_step_saved_again_after_a_resume_replaces_the_old_folder(tmp_path):
    from megatron_rl.run_state import save_run_checkpoint

    save_run_checkpoint(tmp_path, 4, 3, _trainer_part({"old.distcp": b"old"}), lambda: None)
    save_run_checkpoint(tmp_path, 4, 3, _trainer_part({"new.distcp": b"new"}), lambda: None)
    assert (step_dir(tmp_path, 4) / "new.distcp").exists() and not (step_dir(tmp_path, 4) / "old.distcp").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_run_state_checked_against_its_checksum(tmp_path):
    from megatron_rl.run_state import save_run_checkpoint

    folder = save_run_checkpoint(tmp_path, 2, 3, _trainer_part({}), lambda: {"groups": []})
    state = (folder / "run_state.json").read_text()
    (folder / "run_state.json").write_text(state.replace('"step": 2', '"step": 9'))
    with pytest.raises(ResumeError, match=r"run_state.json: corrupted \(its SHA-256 differs"):
        read_run_state(folder)


def test_markers_and_run_state_are_written_durably(tmp_path, monkeypatch):
    """fsync of the new file before its rename, and of the folder after it (a machine crash keeps one of them)."""
    import os as os_module

    synced: list[str] = []
    real_fsync = os_module.fsync

    def fsync(fd):
        synced.append(os_module.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os_module, "fsync", fsync)
    folder = step_dir(tmp_path, 2)
    folder.mkdir()
    write_run_state(folder, 2, None)
    mark_latest(tmp_path, folder)
    assert str(folder / ".run_state.json.tmp") in synced and str(folder) in synced
    assert str(tmp_path / ".latest.tmp") in synced and str(tmp_path) in synced
