"""Megatron-Core (gloo processes) vs Hugging Face transformers, fp32 on CPU, for every family and layout.

All cases run up front in one launch per world size (model-parallel groups rebuilt between cases); each test
then checks its own report.
"""

from __future__ import annotations

import pytest

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.verify.parity import run_parity, run_parity_many

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


def test_logprobs_at_the_sampling_temperature_match_transformers_at_tp2(tiny_dir):
    """The trainer's logprobs at temperature 0.7 (the engines' sampling distribution) are transformers' with its
    logits divided by 0.7, through the vocab-parallel cross entropy of TP2; far from the untempered ones."""
    from megatron_rl.models import family_for_hf_config, read_hf_config
    from megatron_rl.verify.parity import hf_logprobs, megatron_logprobs_many, parity_tokens

    hf = tiny_dir("qwen3_moe")
    config = read_hf_config(hf)
    tokens = parity_tokens(family_for_hf_config(config).arch_from_hf(config).vocab_size, 4, 128)
    (tempered,), _ = megatron_logprobs_many([(hf, ParallelLayout(tp=2), None)], [tokens], temperature=0.7)
    assert (tempered - hf_logprobs(hf, tokens, temperature=0.7)).abs().max() <= TOLERANCE
    assert (tempered - hf_logprobs(hf, tokens)).abs().mean() > 0.1
