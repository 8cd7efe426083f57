"""The benchmarks in bench/ run from a fresh clone and print the JSON object their issues ask for (tiny models:
these check the scripts and their arithmetic, not the speed goals, which need the full-size runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str) -> dict:
    """Run `bench/<script>` and return the one JSON object it prints last."""
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_weight_sync_bench_reports_sync_and_plain_broadcast():
    result = run_bench("weight_sync.py", "--layers", "2", "--hidden", "256", "--bucket-mb", "1", "--repeats", "2")
    assert result["bytes"] == result["model_parameters"] * 4  # fp32
    assert result["buckets"] > 1  # 1 MiB buckets: the double buffer and the posted-ahead receives are used
    for kind in ("sync", "plain"):
        assert result[f"{kind}_seconds"] > 0
        assert result[f"{kind}_gb_per_s"] == pytest.approx(result["bytes"] / result[f"{kind}_seconds"] / 1e9, rel=1e-2)
    assert result["ratio"] == pytest.approx(result["sync_gb_per_s"] / result["plain_gb_per_s"], rel=1e-2)
    assert result["streams"] == result["plain_parallel_in_flight"] == 2  # the default gloo streams
    assert result["ratio_to_parallel"] == pytest.approx(
        result["plain_parallel_seconds"] / result["sync_seconds"], rel=1e-2
    )
    assert result["goal_ratio"] == 0.7
    assert result["engine_side"] and all(phase["seconds"] > 0 for phase in result["engine_side"])


@pytest.mark.slow
def test_weight_sync_bench_ep_case_reports_each_workers_bytes_beside_the_broadcasts():
    result = run_bench(
        "weight_sync.py", "--layers", "2", "--hidden", "256", "--bucket-mb", "1", "--repeats", "2", "--engine-ep"
    )
    ep = result["ep"]
    assert result["engine_tp"] == ep["ep_size"] == 2 and result["engine_ep"] is True
    assert ep["syncs_each"] == 2 and all(len(v) == 2 for v in ep["all_seconds"].values())
    assert ep["time_ratio"] == pytest.approx(ep["owner_aware_seconds"] / ep["broadcast_seconds"], rel=1e-2)
    assert ep["non_expert_bytes"] + ep["expert_bytes"] == result["bytes"]
    share = ep["non_expert_bytes"] + ep["expert_bytes"] / 2
    assert ep["bound_bytes"] == int(share * 1.05) and ep["within_bound"] is True
    assert set(ep["received_bytes_owner_aware"]) == set(ep["received_bytes_broadcast"]) == {"1", "2"}
    for worker, received in ep["received_bytes_owner_aware"].items():
        assert share <= received <= ep["bound_bytes"]  # its own experts, and every non-expert tensor
        assert ep["received_bytes_broadcast"][worker] >= result["bytes"]  # everything


@pytest.mark.slow  # a benchmark's smoke test: conversion itself is tested in tests/distributed/test_convert.py
def test_convert_bench_reports_conversion_and_plain_read_write():
    result = run_bench("convert.py", "--layers", "2", "--hidden", "256", "--experts", "4")
    assert result["layout"].startswith("tp2") and "ep2" in result["layout"]
    assert result["bytes"] > 0
    for kind in ("", "plain_"):
        assert result[f"{kind}seconds"] > 0
        assert result[f"{kind}gb_per_s"] == pytest.approx(result["bytes"] / result[f"{kind}seconds"] / 1e9, rel=0.05)
    assert result["ratio"] == pytest.approx(result["gb_per_s"] / result["plain_gb_per_s"], rel=0.05)
    assert result["wall_seconds"] >= result["seconds"]
    assert {"load_seconds", "save_seconds"} <= set(result["phases_rank0"])


@pytest.mark.slow
def test_routing_mismatch_bench_reports_bf16_mismatch_with_and_without_replay():
    """Issue 18's must-show 4 at its smallest (about 60 s): bf16 numerics alone move some routes, replay makes
    the trainer dispatch to the engine's experts and lowers the k3 mismatch."""
    result = run_bench("routing_mismatch.py", "--dtypes", "bfloat16", "--prompts", "2", "--response-len", "24")
    bf16 = result["results"]["bfloat16"]
    assert result["router_perturbation"] == 0.0 and bf16["num_response_tokens"] == 48
    assert bf16["agreement_with_replay"] == 1.0
    assert bf16["k3_kl_without_replay"] > bf16["k3_kl_with_replay"] > 0
    assert bf16["k3_ratio_without_over_with"] == pytest.approx(
        bf16["k3_kl_without_replay"] / bf16["k3_kl_with_replay"], rel=1e-6
    )


@pytest.mark.slow
def test_distill_bench_reports_async_and_sync_tokens_per_s():
    """Issue 16's must-show 6 at its smallest (two 5-step distillation runs, about 4 min): one JSON object with
    each mode's trained tokens/s and their ratio."""
    result = run_bench("distill_async.py", "--steps", "5")
    assert set(result) >= {"sync", "async", "trained_tokens_per_s_ratio"} and result["steady_from_step"] == 4
    for mode in ("sync", "async"):
        figures = result[mode]
        assert figures["trained_tokens_per_s"] > 0 and 0 <= figures["teacher_idle_frac"] <= 1
        assert figures["reverse_kl_first"] > 0.1  # a teacher of other weights: a real KL to learn from
    assert result["sync"]["mean_staleness"] == 0
    ratio = result["async"]["trained_tokens_per_s"] / result["sync"]["trained_tokens_per_s"]
    assert result["trained_tokens_per_s_ratio"] == pytest.approx(ratio, rel=1e-2)


@pytest.mark.slow
def test_lora_sync_bench_reports_adapter_and_full_sync_bytes_and_seconds():
    result = run_bench("lora_sync.py", "--hidden", "256", "--syncs", "2")
    lora, full = result["lora"], result["full"]
    assert full["bytes"] == result["model_parameters"] * 4  # fp32
    assert lora["bytes"] <= lora["sent_bytes"] <= lora["bytes"] * 1.01  # the adapters, headers and alignment
    assert result["bytes_ratio"] == pytest.approx(lora["sent_bytes"] / full["sent_bytes"], rel=1e-3)
    assert result["bytes_ratio"] < 0.2
    assert lora["sync_seconds"] > 0 and full["sync_seconds"] > 0
    assert max(lora["max_abs_logprob_diff"], full["max_abs_logprob_diff"]) <= 1e-3


@pytest.mark.slow
def test_floor_bench_times_every_part_and_derives_the_floors():
    result = run_bench("floor.py", "--steps", "2", "--compiled")
    parts = ["hf_update_share_1t", "hf_update_whole_2t", "hf_generate_2t", "vllm_generate_1t", "megatron_step_ep2"]
    assert all(result[f"{part}_s"] > 0 for part in [*parts, "vllm_generate_compiled_1t"])
    assert all(result[f"{part}_cpu_s"] > 0 for part in parts)  # megatron's: both ranks' CPU seconds
    assert result["vllm_generate_1t_startup_s"] > 0 and result["vllm_generate_compiled_1t_startup_s"] > 0
    share, vllm = result["hf_update_share_1t_s"], result["vllm_generate_1t_s"]
    assert result["floor_disaggregated_s"] == pytest.approx((2 * share + vllm) / 2, abs=1e-3)
    sync = result["hf_update_whole_2t_s"] + result["hf_generate_2t_s"]
    assert result["floor_sync_s"] == pytest.approx(sync, abs=1e-3)
    assert result["megatron_step_over_hf_share"] == pytest.approx(result["megatron_step_ep2_s"] / share, rel=1e-2)
    hf_cpu = 2 * result["hf_update_share_1t_cpu_s"]
    assert result["megatron_cpu_over_hf_shares"] == pytest.approx(result["megatron_step_ep2_cpu_s"] / hf_cpu, rel=1e-2)
    ours = (result["megatron_step_ep2_cpu_s"] + result["vllm_generate_1t_cpu_s"]) / 2
    assert result["floor_ours_s"] == pytest.approx(ours, abs=1e-3)
    assert result["floor_ours_over_sync"] == pytest.approx(ours / result["floor_sync_s"], rel=1e-2)


@pytest.mark.slow
def test_loop_cpu_bench_splits_a_steps_cpu_by_process_and_trainer_thread():
    result = run_bench("loop_cpu.py", "--steps", "120", "--from-step", "30", "--window-s", "8")
    roles, threads = result["cpu_ms_per_step"], result["trainer_threads_ms_per_step"]
    assert result["steps"] > 0 and result["steps_per_s"] > 0
    assert all(roles[role] > 0 for role in ("trainer_ranks", "engine", "driver", "buffer", "run_control"))
    assert sum(roles.values()) == pytest.approx(result["total_ms_per_step"], abs=1.0)
    assert sum(threads.values()) == pytest.approx(roles["trainer_ranks"], abs=1.0)
    assert threads["main"] > 0 and threads["gloo"] > 0  # the ranks' own work and gloo's threads, apart
    assert 0 < result["cores_busy"] <= 1.05
    switches, threads = result["context_switches_per_step"], result["threads"]
    assert switches["trainer_ranks"] > 0 and switches["engine"] > 0
    assert threads["trainer_ranks"] >= 4 and threads["engine"] >= 2  # two ranks with gloo's threads; vLLM's


def test_gloo_calls_bench_times_each_collective_on_two_ranks():
    result = run_bench("gloo_calls.py", "--calls", "50")
    names = ["all_to_all_single_256KB", "all_to_all_single_16B", "all_reduce_1", "all_reduce_2_float64",
             "all_reduce_8", "broadcast_16B", "all_gather_into_tensor_16B", "barrier", "all_gather_object"]  # fmt: skip
    assert result["ranks"] == 2 and sorted(k for k in result if k not in ("ranks", "calls")) == sorted(names)
    assert all(result[n]["cpu_ms"] > 0 and result[n]["wall_ms"] > 0 for n in names)


def test_reward_isolation_bench_times_math_rewards_on_threads_and_in_processes():
    result = run_bench("reward_isolation.py", "--groups", "8", "--samples", "8", "--rounds", "1")
    assert result["calls_per_round"] == 64 and result["rounds"] == 1
    for mode in ("thread", "process"):
        assert result[mode]["wall_ms_per_call"] > 0 and result[mode]["cpu_ms_per_call"] > 0
    ratio = result["process_over_thread"]["wall_ms_per_call"]
    assert ratio == round(result["process"]["wall_ms_per_call"] / result["thread"]["wall_ms_per_call"], 3)


@pytest.mark.slow
def test_engine_requests_bench_times_each_way_of_handing_requests_to_vllm():
    result = run_bench("engine_requests.py", "--rounds", "3")
    cpu, ratios = result["cpu_ms_per_round"], result["ratio_to_vllm_defaults"]
    assert sorted(cpu) == sorted(ratios) == ["ours", "own_params", "vllm_defaults"]
    assert all(ms > 0 for ms in cpu.values()) and ratios["vllm_defaults"] == 1.0
    assert ratios["ours"] == pytest.approx(cpu["ours"] / cpu["vllm_defaults"], abs=2e-3)


@pytest.mark.slow
def test_engine_core_bench_times_both_placements_of_the_engine_core():
    result = run_bench("engine_core.py", "--rounds", "2")
    for mode in ("own_process", "in_process"):
        assert result[mode]["s"] > 0 and result[mode]["cpu_s"] > 0
    assert result["cpu_ratio_in_over_own"] == pytest.approx(
        result["in_process"]["cpu_s"] / result["own_process"]["cpu_s"], abs=2e-3
    )


@pytest.mark.slow
def test_ray_calls_bench_times_each_way_of_sending_a_burst():
    result = run_bench("ray_calls.py", "--rounds", "20")
    ways = ["one_call_per_group", "one_call_per_burst", "one_call_per_group_sequential"]
    assert all(result[w]["cpu_ms"] > 0 and result[w]["wall_ms"] > 0 for w in ways)
    assert result["burst_over_group_cpu"] == pytest.approx(
        result["one_call_per_burst"]["cpu_ms"] / result["one_call_per_group"]["cpu_ms"], abs=2e-3
    )


def test_peer_trl_refuses_overrides_that_change_the_shared_settings():
    """`bench/peer_trl.py` compares like with like: before any run, the quickstart (with the overrides) must have
    the task and optimizer settings the TRL side uses; an override of megatron-rl's own options is fine."""
    own = run_bench(
        "peer_trl.py", "--seeds", "0", "--only", "mrl", "--mrl-override", "trainer.micro_batch_tokens=2048",
        "--size", "wide",
    )  # fmt: skip
    assert own["mrl_overrides"] == ["trainer.micro_batch_tokens=2048"] and own["per_seed"] == {"mrl": [], "trl": []}
    assert "hidden 512" in own["model"]  # `--size wide` names the compute model it would run
    proc = subprocess.run(
        [sys.executable, "bench/peer_trl.py", "--only", "mrl", "--mrl-override", "rollout.temperature=0.7"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "{'temperature': (0.7, 1.0)}" in proc.stderr, proc.stderr[-2000:]
