"""Trainer rank 0's reading of `eval.jsonl`: oldest first, none lost, the last step waits for the last one."""

from __future__ import annotations

import json

from megatron_rl.metrics.evals import EVAL_FILE, EvalInbox


def _append(run_dir, *versions: int, torn: str = "") -> None:
    with (run_dir / EVAL_FILE).open("a") as handle:
        handle.writelines(json.dumps({"eval/version": v, "eval/reward_mean": v / 10}) + "\n" for v in versions)
        handle.write(torn)


def test_results_are_handed_out_oldest_first_and_none_is_lost(tmp_path):
    inbox = EvalInbox(tmp_path)
    assert inbox.take() == {}  # no file yet
    _append(tmp_path, 2, 4, torn='{"eval/version": 6')  # two arrived between steps; a third is being written
    assert inbox.take()["eval/version"] == 2
    assert inbox.take()["eval/version"] == 4
    assert inbox.take() == {}  # the torn line is not read
    with (tmp_path / EVAL_FILE).open("a") as handle:
        handle.write("}\n")
    assert inbox.take()["eval/version"] == 6


def test_the_last_step_drains_everything_once_its_version_is_in(tmp_path):
    inbox = EvalInbox(tmp_path)
    _append(tmp_path, 2, 4)
    assert [r["eval/version"] for r in inbox.drain_until(4, timeout_s=5)] == [2, 4]
    assert inbox.take() == {}


def test_a_missing_last_evaluation_is_said_after_the_timeout(tmp_path):
    inbox = EvalInbox(tmp_path)
    assert inbox.drain_until(4, timeout_s=0.2, poll_s=0.05) == [{"eval/missing": 4}]
    _append(tmp_path, 2)
    assert inbox.drain_until(4, timeout_s=0.2, poll_s=0.05) == [{"eval/version": 2, "eval/reward_mean": 0.2,
                                                                  "eval/missing": 4}]  # fmt: skip
