"""The trainer's process groups time out when `init_distributed` says (two gloo processes at TP2)."""

from __future__ import annotations

import json

from megatron_rl.parallel.torchrun import run_torchrun
from tests.support.group_timeout_worker import TIMEOUT_S


def test_every_group_takes_the_configured_timeout_and_a_missing_peer_fails_within_it(tmp_path):
    """Megatron takes its groups' timeout in minutes: it was rounded down to whole minutes (at least one), so a
    90 s setting gave Megatron's groups 60 s and a 5 s one 60 s; and it made its expert data-parallel gloo group
    without a timeout (torch's 30 minutes)."""
    out = tmp_path / "report.json"
    run_torchrun("tests.support.group_timeout_worker", [str(out)], 2, timeout_s=180, log_path=tmp_path / "log.txt")
    report = json.loads(out.read_text())
    names = ("world", "tp", "dp", "ep", "pp", "dp_gloo", "expert_dp_gloo")
    assert report["timeouts"] == dict.fromkeys(names, TIMEOUT_S), report
    assert report["raised"] is not None and TIMEOUT_S - 0.5 <= report["failed_after_s"] < TIMEOUT_S + 2, report
