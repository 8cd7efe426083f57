"""Megatron-Core (gloo processes) vs Hugging Face transformers, fp32 on CPU, for every family and layout."""

from __future__ import annotations

import pytest

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.tools.parity import run_parity

MOE_LAYOUTS = {
    "1x1x1": ParallelLayout(),
    "tp2": ParallelLayout(tp=2),
    "pp2": ParallelLayout(pp=2),
    "ep2": ParallelLayout(ep=2),
    "tp2xep2": ParallelLayout(tp=2, ep=2, etp=1),
    "pp2xep2": ParallelLayout(pp=2, ep=2),
}
DENSE_LAYOUTS = {k: v for k, v in MOE_LAYOUTS.items() if v.ep == 1}
CASES = [(f, name, layout) for f in ("qwen3_moe", "mixtral", "deepseek_v3") for name, layout in MOE_LAYOUTS.items()]
CASES += [("qwen3", name, layout) for name, layout in DENSE_LAYOUTS.items()]
TOLERANCE = 1e-4


def _check(report):
    assert report["num_tokens"] >= 512
    assert report["max_abs_logprob_diff"] <= TOLERANCE, report
    # The model is far from uniform, so agreement is not trivial.
    assert report["mean_logprob"] < -6.5


@pytest.mark.parametrize("family, name, layout", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_parity(family, name, layout, tiny_dir):
    _check(run_parity(tiny_dir(family), layout))


def test_parity_tp2_pp2_ep2_qwen3_moe(tiny_dir):
    """Three-way layout on the smallest world that holds it (4 processes: EP folds over TP)."""
    _check(run_parity(tiny_dir("qwen3_moe"), ParallelLayout(tp=2, pp=2, ep=2)))


@pytest.mark.slow
def test_parity_tp2_pp2_ep2_dp2_qwen3_moe(tiny_dir):
    """The same layout with data parallel 2: 8 processes on this machine."""
    _check(run_parity(tiny_dir("qwen3_moe"), ParallelLayout(tp=2, pp=2, ep=2, dp=2), timeout_s=1500))
