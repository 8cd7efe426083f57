"""When the snapshot teachers are refreshed (`weights/snapshot.py`), on one real gloo rank: a due refresh waits
while a restarted teacher is not back, the step's metrics say it is owed, and it is made (with the current
version) as soon as the teacher is back; a failed refresh is owed too, and fails the run after `max_failures`.
The teachers' Ray side (`restarted`, `_all_ready`) and the weight sync are replaced: this is the plan's logic."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from megatron_rl.weights.snapshot import SnapshotTeachers
from megatron_rl.weights.sync import SyncError


class _Sync:
    """What SnapshotTeachers uses of a TrainerWeightSync: the versions pushed, failing while `fail` is set."""

    is_coordinator = True
    engines: list = []

    def __init__(self):
        self.pushed: list[int] = []
        self.fail = False

    def setup(self) -> None:
        pass

    def push(self, version: int) -> None:
        if self.fail:
            raise SyncError("teacher-0: connection closed")
        self.pushed.append(version)


class _Teachers(SnapshotTeachers):
    back = True
    restart = False

    def restarted(self) -> bool:
        return self.restart

    def _all_ready(self) -> bool:
        return self.back


@pytest.fixture
def one_rank(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _owed_and_version(metrics: dict) -> tuple[float, int]:
    return metrics["distill/teacher_refresh_owed"], metrics["distill/teacher_weights_version"]


def test_a_refresh_due_while_a_teacher_restarts_is_owed_until_it_is_back(one_rank):
    sync = _Sync()
    teachers = _Teachers(sync, refresh_every=3)
    assert _owed_and_version(teachers.after_step(2)) == (0.0, 0)
    assert _owed_and_version(teachers.after_step(3)) == (0.0, 3)
    teachers.restart, teachers.back = True, False  # killed after step 3, not back yet
    assert _owed_and_version(teachers.after_step(5)) == (1.0, 3)  # not due, but the restart is noticed
    assert _owed_and_version(teachers.after_step(6)) == (1.0, 3)  # due: waits for the teacher
    assert teachers.plan(6, due=False) is None  # the trainer's wait for a batch asks again: still not back
    teachers.back = True
    plan = teachers.plan(6, due=False)
    assert plan == {"reform": True}
    teachers.refresh(plan, 6)
    teachers.restart = False  # the weight group is formed with the new actor
    assert _owed_and_version(teachers.after_step(7)) == (0.0, 6)
    assert sync.pushed == [3, 6] and teachers.refreshes == 2


def test_a_failed_refresh_is_owed_and_fails_the_run_after_max_failures(one_rank):
    sync = _Sync()
    teachers = _Teachers(sync, refresh_every=2, max_failures=2)
    sync.fail = True
    assert _owed_and_version(teachers.after_step(2)) == (1.0, 0)
    sync.fail = False
    assert _owed_and_version(teachers.after_step(3)) == (0.0, 3)  # tried again at the next step, with its version
    sync.fail = True
    teachers.after_step(4)
    with pytest.raises(SyncError, match="failed 2 times in a row: teacher-0: connection closed"):
        teachers.after_step(5)
