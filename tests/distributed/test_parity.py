"""Megatron-Core (gloo processes) vs Hugging Face transformers, fp32 on CPU, for every family and layout.

All cases run up front in one launch per world size (model-parallel groups rebuilt between cases); each test
then checks its own report.
"""

from __future__ import annotations

import pytest

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.tools.parity import run_parity, run_parity_many

MOE_LAYOUTS = {
    "1x1x1": ParallelLayout(),
    "tp2": ParallelLayout(tp=2),
    "pp2": ParallelLayout(pp=2),
    "ep2": ParallelLayout(ep=2),
    "tp2xep2": ParallelLayout(tp=2, ep=2, etp=1),
    "pp2xep2": ParallelLayout(pp=2, ep=2),
}
DENSE_LAYOUTS = {k: v for k, v in MOE_LAYOUTS.items() if v.ep == 1}
CASES = [(f, name) for f in ("qwen3_moe", "mixtral", "deepseek_v3") for name in MOE_LAYOUTS]
CASES += [("qwen3", name) for name in DENSE_LAYOUTS]
CASES += [("qwen3_moe", "tp2xpp2xep2")]
LAYOUTS = {**MOE_LAYOUTS, "tp2xpp2xep2": ParallelLayout(tp=2, pp=2, ep=2)}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reports(tiny_dir):
    cases = [(tiny_dir(family), LAYOUTS[name], None) for family, name in CASES]
    return dict(zip(CASES, run_parity_many(cases)))


def _check(report):
    assert report["num_tokens"] >= 512
    assert report["max_abs_logprob_diff"] <= TOLERANCE, report
    # The model is far from uniform (log 512 = -6.24), so agreement is not trivial.
    assert report["mean_logprob"] < -6.5


@pytest.mark.parametrize("family, name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_parity(family, name, reports):
    report = reports[(family, name)]
    assert report["family"] == family
    assert report["layout"] == LAYOUTS[name].describe()
    _check(report)


@pytest.mark.slow
def test_parity_tp2_pp2_ep2_dp2_qwen3_moe(tiny_dir):
    """TP2xPP2xEP2 with data parallel 2: 8 processes on this machine."""
    _check(run_parity(tiny_dir("qwen3_moe"), ParallelLayout(tp=2, pp=2, ep=2, dp=2), timeout_s=1500))
