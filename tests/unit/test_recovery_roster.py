"""Rank 0's roster reads between batches: at most one per `poll_s`, and a restart (a new epoch with no engine
down) is reported once."""

from __future__ import annotations

import types

import ray

from megatron_rl.weights import recovery
from megatron_rl.weights.recovery import RecoveringSync


class Control:
    """The run-control actor's `roster`, behind Ray's call syntax (`ray.get` is patched to pass values through)."""

    def __init__(self):
        self.rosters = [{"epoch": 0, "down": [], "engines": ["e0"]}]
        self.reads = 0
        self.roster = types.SimpleNamespace(remote=self._read)

    def _read(self) -> dict:
        self.reads += 1
        return self.rosters[-1]


def test_the_roster_is_read_at_most_once_per_poll_interval_and_a_restart_is_seen_once(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    control = Control()
    sync = RecoveringSync(sync=types.SimpleNamespace(is_coordinator=True), control=control, timeout_s=5, poll_s=1.0)
    assert sync.roster_changed() is None and control.reads == 1
    clock[0] += 0.4
    control.rosters.append({"epoch": 1, "down": ["e0"], "engines": ["e0"]})  # e0 died: not back yet
    assert sync.roster_changed() is None and control.reads == 1  # within the interval: not asked
    clock[0] += 0.7
    assert sync.roster_changed() is None and control.reads == 2  # asked: still down
    control.rosters.append({"epoch": 1, "down": [], "engines": ["e0-restarted"]})
    clock[0] += 1.0
    assert sync.roster_changed()["engines"] == ["e0-restarted"] and control.reads == 3
