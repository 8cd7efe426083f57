"""`megatron-rl export` finds the checkpoint a run folder, a save_dir or a step folder names."""

from __future__ import annotations

import pytest

from megatron_rl.commands.export import CHECKPOINT_META, checkpoint_of
from megatron_rl.errors import UserError
from megatron_rl.run_state import mark_latest, step_dir, write_run_state


def _checkpoint(save_dir, step):
    folder = step_dir(save_dir, step)
    folder.mkdir(parents=True)
    (folder / CHECKPOINT_META).write_text("{}")
    write_run_state(folder, step, None)
    return folder


def test_sources_resolve_to_the_latest_or_the_asked_step(tmp_path):
    save_dir = tmp_path / "ckpt"
    first, second = _checkpoint(save_dir, 2), _checkpoint(save_dir, 4)
    mark_latest(save_dir, second)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"checkpoint:\n  save_dir: {save_dir}\n")
    assert checkpoint_of(save_dir) == second
    assert checkpoint_of(run_dir) == second
    assert checkpoint_of(run_dir, step=2) == first
    assert checkpoint_of(first) == first
    with pytest.raises(UserError, match="no checkpoint of step 3"):
        checkpoint_of(save_dir, step=3)
    with pytest.raises(UserError, match="does not apply"):
        checkpoint_of(first, step=2)


def test_a_run_without_checkpoints_points_at_its_final_export(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("steps: 3\n")
    with pytest.raises(UserError, match=r"saved no checkpoints .* exported in .*r/hf"):
        checkpoint_of(run_dir)
    with pytest.raises(UserError, match="neither a run folder"):
        checkpoint_of(tmp_path / "nothing")
