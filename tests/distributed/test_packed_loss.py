"""The train step's loss function on packed rows (`trainer/micro_batches.LossLayout`: logprobs, entropy, the
sampling mask's kept sets and the top-k KL computed on the packed logits, only per-token results unpacked) gives
the padded layout's loss, per-token results and logit gradients; one torchrun process (Megatron's vocab-parallel
cross entropy needs its groups)."""

from __future__ import annotations

import json

from megatron_rl.parallel.torchrun import run_torchrun


def test_the_loss_on_packed_logits_equals_the_padded_one(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun("tests.support.packed_loss_worker", [str(out)], 1, timeout_s=180, log_path=tmp_path / "log.txt")
    report = json.loads(out.read_text())
    print(report)
    rows, width = report["rows"]
    assert rows * width < report["padded_positions"]  # fewer positions' logits than the padded layout's
    padded, packed = report["loss"]
    assert abs(padded - packed) <= 1e-6 and abs(padded) > 1e-3
    for key in ("logprobs", "entropy", "top_kl"):
        assert report[key] <= 1e-5, (key, report[key])
    assert report["outside_equal"] and report["outside_any"]  # some labels fall outside the mask, the same ones
    assert report["grad"] <= 1e-6 and report["grad_max"] > 1e-3 and report["padding_grad"] == 0.0
    assert report["top_kl_mean"] > 0.1
    # Packed padding keeps every token (as the batch's own padding does): only the unidentified sets are recomputed.
    padded_recomputed, packed_recomputed = report["recomputed"]
    assert packed_recomputed == padded_recomputed == report["unidentified_positions"] > 0
