"""The top-k distillation loss on vocab-parallel logits (`trainer/logprobs.vocab_parallel_logprobs_at`,
`algorithms/distill.top_k_kl`): two gloo processes at TP2 give the values and gradients of one process on the
whole logits."""

from __future__ import annotations

import json

from megatron_rl.parallel.torchrun import run_torchrun


def test_top_k_kl_at_tp2_equals_the_whole_vocabulary(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun("tests.support.top_kl_worker", [str(out)], 2, timeout_s=180, log_path=tmp_path / "log.txt")
    report = json.loads(out.read_text())
    print(report)
    assert report["logprob"] <= 1e-5
    for kind in ("forward", "reverse"):
        assert report[kind]["value"] <= 1e-5 and report[kind]["grad"] <= 1e-6, (kind, report[kind])
        assert report[kind]["kl_mean"] > 0.1  # a real KL, not two equal distributions
