"""Uneven pipeline stages (Megatron's num_layers_in_first/last_pipeline_stage), as DeepSeek-V3's 61 layers need.

Tiny checkpoints whose layer count PP2 does not split evenly (qwen3_moe with 3 layers) or splits 1+3 (deepseek_v3's
4 layers, the first dense): `megatron-rl verify parity` against transformers through the command line, and a
conversion round trip through the weight-gather path (save at first=1, load at last=1, write HF, compare).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl.models.tiny import make_tiny
from megatron_rl.parallel.layout import ParallelLayout

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def uneven_dirs(tmp_path_factory):
    """family -> a tiny checkpoint with a layer count that an even PP2 split cannot (or does not) give 1+rest."""
    root = tmp_path_factory.mktemp("uneven")
    return {
        "qwen3_moe": str(make_tiny("qwen3_moe", root / "qwen3_moe", seed=0, overrides={"num_hidden_layers": 3})),
        "deepseek_v3": str(make_tiny("deepseek_v3", root / "deepseek_v3", seed=0)),  # 4 layers, layer 0 dense
    }


def _verify_parity(hf_dir: str, *layout_args: str) -> dict:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "verify", "parity", "--hf", hf_dir, *layout_args, "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family, layers", [("qwen3_moe", 3), pytest.param("deepseek_v3", 4, marks=pytest.mark.slow)])
def test_parity_pp2_first_stage_one_layer(family, layers, uneven_dirs):
    report = _verify_parity(uneven_dirs[family], "--pp", "2", "--first-stage-layers", "1")
    assert report["family"] == family
    assert report["layout"] == "tp1-pp2-ep1-etp1-dp1-first1"
    assert report["num_tokens"] >= 512
    assert report["max_abs_logprob_diff"] <= TOLERANCE, report
    assert report["passed"] is True
    # Far from uniform (log 512 = -6.24): a stage that built the wrong layers or skipped one would not agree.
    assert report["mean_logprob"] < -6.5


def test_uneven_layout_that_does_not_divide_is_refused_by_the_cli(uneven_dirs):
    cmd = [sys.executable, "-m", "megatron_rl.cli", "verify", "parity", "--hf", uneven_dirs["qwen3_moe"]]
    result = subprocess.run([*cmd, "--pp", "2", "--first-stage-layers", "3"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "parallel.first_stage_layers=3" in result.stderr and "3 layers" in result.stderr


def test_convert_round_trip_across_uneven_layouts(uneven_dirs, tmp_path):
    """hf -> mcore saved at 1+2 layers per stage, loaded at 2+1 and gathered back to HF: bit-identical."""
    from megatron_rl.verify.roundtrip import compare_hf_checkpoints
    from megatron_rl.weights.convert import hf_to_mcore, mcore_to_hf

    hf_dir = uneven_dirs["qwen3_moe"]
    hf_to_mcore(hf_dir, str(tmp_path / "mcore"), ParallelLayout(pp=2, first_stage_layers=1), timeout_s=600)
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), ParallelLayout(pp=2, last_stage_layers=1), timeout_s=600)
    report = compare_hf_checkpoints(hf_dir, str(tmp_path / "hf"))
    assert report["identical"] is True, report
