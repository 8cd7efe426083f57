"""The planner: parameter counts against published totals and against transformers, per-GPU memory worked out by
hand for one production config, every shipped config plans, broken ones are refused with the field named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.models import family_for_hf_config, get_family
from megatron_rl.planner import GB, TINY_VOCAB, ModelSize, PlanError, kv_bytes_per_token, model_size, plan
from megatron_rl.planner.planning import checked_model

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "configs").glob("**/*.yaml"))
MODELS = ROOT / "configs" / "models"


def _arch(name: str):
    hf = json.loads((MODELS / f"{name}.json").read_text())
    return family_for_hf_config(hf).arch_from_hf(hf), hf


@pytest.mark.parametrize(
    "name, total_b, active_b",
    [
        ("qwen3_30b_a3b", 30.5, 3.3),
        ("qwen3_235b_a22b", 235.0, 22.0),
        # 671B without the multi-token-prediction layer (another 14B in the checkpoint, not trained here); 37B active.
        ("deepseek_v3", 671.0, 37.0),
        ("mixtral_8x7b", 46.7, 12.9),
    ],
)
def test_parameter_counts_match_published_totals(name, total_b, active_b):
    arch, hf = _arch(name)
    size = model_size(arch, hf)
    assert size.total / 1e9 == pytest.approx(total_b, rel=0.02)
    assert size.active / 1e9 == pytest.approx(active_b, rel=0.02)


# Recorded at a890f8b, before the planner asked the model families for attention counts: total, active and
# routed-expert parameters.
@pytest.mark.parametrize(
    "name, total, active, expert",
    [
        ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704, 28_991_029_248),
        ("qwen3_235b_a22b", 235_093_634_560, 22_190_763_520, 227_096_395_776),
        ("deepseek_v3", 671_026_404_352, 37_552_282_624, 653_908_770_816),
        ("mixtral_8x7b", 46_702_792_704, 12_879_925_248, 45_097_156_608),
    ],
)
def test_parameter_counts_of_shipped_configs_are_unchanged(name, total, active, expert):
    arch, hf = _arch(name)
    assert model_size(arch, hf) == ModelSize(total=total, active=active, expert=expert)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "qwen3"])
def test_parameter_counts_equal_transformers_models(family):
    """The formulas count exactly what transformers builds (tiny configs, on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fam = get_family(family)
    hf = fam.tiny_hf_config(TINY_VOCAB)
    kwargs = dict(hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    assert model_size(fam.arch_from_hf(hf), hf).total == sum(p.numel() for p in model.parameters())


def test_tiny_vocab_is_make_tiny_s():
    from megatron_rl.models.tiny import TINY_VOCAB as MADE

    assert TINY_VOCAB == MADE


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_plans(path):
    result = plan(load_config(path))
    worst = result.trainer.worst
    assert 0 < worst.total_bytes <= result.trainer.gpu_memory_bytes
    assert result.engines.max_sequences >= 1
    assert json.loads(json.dumps(result.to_dict()))["trainer"]["layout"] == result.trainer.layout


def test_quickstart_plans_the_tiny_model_without_a_checkpoint(tmp_path):
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"model.hf_path={tmp_path / 'absent'}"])
    result = plan(cfg)
    assert result.model_source == "tiny qwen3_moe"
    assert result.trainer_gpus == 2 and result.inference_gpus == 1


def test_qwen3_30b_a3b_by_hand():
    """configs/qwen3_30b_a3b.yaml: tp2 pp1 ep8 etp1 dp8 (edp = 2*8/(8*1) = 2), bf16, distributed optimizer."""
    result = plan(load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml"))
    h, vocab, layers, experts, moe_ffn = 2048, 151936, 48, 128, 768
    q, kv = 32 * 128, 4 * 128
    # Tensor-parallel weights: per layer q,k,v (h x (q + 2kv)) and o (q x h); embedding and output layer (V x h).
    attn = h * (q + 2 * kv) + q * h  # 18,874,368
    tp_part = layers * attn + 2 * vocab * h  # 905,969,664 + 622,329,856 = 1,528,299,520
    # Whole on every rank: per layer 2 RMSNorms (h each), q/k norms (head_dim each), router (E x h); final norm.
    replicated = layers * (2 * h + 2 * 128 + experts * h) + h  # 12,793,856
    expert = layers * experts * 3 * h * moe_ffn  # 28,991,029,248
    assert (attn, tp_part, replicated, expert) == (18_874_368, 1_528_299_520, 12_793_856, 28_991_029_248)
    dense_local = tp_part // 2 + replicated  # 776,943,616 on each GPU (tp = 2)
    expert_local = expert // 8  # 3,623,878,656 (ep = 8)
    # Adam m, v and the fp32 main copy: 12 bytes, sharded over dp = 8 (dense) and edp = 2 (experts).
    optimizer = 12 * (dense_local // 8 + expert_local // 2)
    assert optimizer == 22_908_687_360  # 22.9 GB
    stage = result.trainer.stages[0]
    assert stage.params == dense_local + expert_local
    assert stage.param_bytes == 2 * (dense_local + expert_local)  # bf16: 8.80 GB
    assert stage.grad_bytes == 4 * (dense_local + expert_local)  # fp32 main_grad buffer: 17.6 GB
    assert stage.optimizer_bytes == optimizer
    # Engines at TP2 without EP: experts split by width over 2 GPUs, like the attention.
    assert result.engines.weight_bytes == 2 * (tp_part // 2 + replicated + expert // 2)
    assert result.engines.kv_bytes_per_token == 2 * (4 // 2) * 128 * layers * 2  # k and v, 2 kv heads per GPU
    budget = int(0.85 * 80 * GB)
    assert result.engines.kv_cache_bytes == budget - result.engines.weight_bytes - result.engines.overhead_bytes
    assert result.engines.kv_cache_tokens == result.engines.kv_cache_bytes // 49_152
    # A weight sync brings every engine GPU each tensor whole (vLLM cuts its shard), every expert included.
    assert result.engines.sync_bytes_per_gpu == result.engines.sync_bytes_per_gpu_broadcast
    assert result.engines.sync_bytes_per_gpu == 2 * (tp_part + replicated + expert)
    # With expert parallelism over the engine's 2 GPUs each holds, and receives, half of the experts whole.
    ep = plan(load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", ["rollout.engine_ep=true"]))
    assert ep.engines.weight_bytes == 2 * (tp_part // 2 + replicated + expert // 2)
    assert ep.engines.sync_bytes_per_gpu == 2 * (tp_part + replicated + expert // 2)
    assert ep.engines.sync_bytes_per_gpu_broadcast == result.engines.sync_bytes_per_gpu


def test_teacher_engines_are_planned_and_counted_in_the_inference_gpus(tmp_path):
    """On-policy distillation: a snapshot teacher at TP4 (the policy's shape) and a fixed fp32 teacher of another
    size at TP1, each beside 6 student engines at TP2 on the 16 inference GPUs; by hand from the counts above."""
    base = ["rollout.num_engines=6", "distill.teacher=snapshot", "distill.num_engines=1", "distill.engine_tp=4"]
    result = plan(load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", base))
    tp_part, replicated, expert = 1_528_299_520, 12_793_856, 28_991_029_248
    t = result.teachers
    assert result.inference_gpus == 16 and (t.num_engines, t.gpus_per_engine) == (1, 4)
    assert t.weight_bytes == 2 * (tp_part // 4 + replicated + expert // 4)  # bf16, experts split by width
    assert t.kv_bytes_per_token == 2 * (4 // 4) * 128 * 48 * 2  # one kv head per GPU
    assert t.overhead_bytes == result.engines.overhead_bytes  # synced: the same receive buffers
    assert t.sync_bytes_per_gpu == 2 * (tp_part + replicated + expert)
    assert result.to_dict()["teachers"]["per_gpu_gb"]["weights"] == round(t.weight_bytes / GB, 2)
    small = dict(json.loads((ROOT / "configs" / "models" / "qwen3_30b_a3b.json").read_text()), num_hidden_layers=24)
    (tmp_path / "config.json").write_text(json.dumps(small))
    fixed = [*base[:1], "distill.teacher=hf", f"distill.teacher_path={tmp_path}", "distill.teacher_dtype=float32",
             "distill.num_engines=4", "distill.engine_tp=1"]  # fmt: skip
    t = plan(load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", fixed)).teachers
    assert t.weight_bytes == 4 * (tp_part - 24 * 18_874_368 + replicated // 2 + 1024 + expert // 2)
    assert t.overhead_bytes == 4 * GB and t.sync_bytes_per_gpu == 0  # never synced: no receive buffers
    with pytest.raises(PlanError, match=r"plus distill.num_engines\*engine_tp = 1\*4 = 4"):
        plan(load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", base[1:]))
    elsewhere = [*fixed, "distill.teacher_path=/nowhere", "distill.num_engines=1", "distill.engine_tp=4"]
    later = plan(load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", elsewhere))
    assert later.teacher_source == "the policy's shape (/nowhere/config.json does not exist yet)"
    assert later.teachers.weight_bytes == 4 * (tp_part // 4 + replicated + expert // 4)  # the policy's, fp32
    with pytest.raises(PlanError, match="distill.engine_tp=1: the teacher's weights 122.13 GB"):  # 30B in fp32
        plan(
            load_config(
                ROOT / "configs" / "qwen3_30b_a3b.yaml", [*elsewhere, "distill.num_engines=4", "distill.engine_tp=1"]
            )
        )


def test_mla_kv_cache_is_the_latent():
    arch, _ = _arch("deepseek_v3")
    assert kv_bytes_per_token(arch, engine_tp=8, dtype_bytes=2) == (512 + 64) * 61 * 2
    arch, _ = _arch("qwen3_235b_a22b")  # 4 kv heads at TP8: vLLM keeps one (replicated) per GPU
    assert kv_bytes_per_token(arch, engine_tp=8, dtype_bytes=2) == 2 * 1 * 128 * 94 * 2


def test_deepseek_uneven_stages_are_planned():
    result = plan(load_config(ROOT / "configs" / "deepseek_v3.yaml"))
    assert result.trainer.stage_layers == [5, 8, 8, 8, 8, 8, 8, 8]
    assert result.trainer.layout == "tp8-pp8-ep16-etp1-dp2-first5"


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        ("qwen3_30b_a3b", ["trainer.parallel.tp=1", "trainer.parallel.ep=3", "trainer.parallel.dp=3"],
         r"trainer.parallel.ep=3: the model's experts \(128\) is not divisible by 3"),
        ("deepseek_v3", ["trainer.parallel.first_stage_layers=4"],
         r"trainer.parallel.first_stage_layers=4: the remaining 57 of the model's 61 layers"),
        ("deepseek_v3", ["trainer.parallel.first_stage_layers=null"],
         r"trainer.parallel.pp=8: the model's layers \(61\) is not divisible by 8"),
        ("qwen3_30b_a3b", ["cluster.trainer_nodes=3"],
         r"cluster.trainer_nodes=3 x gpus_per_node=8 = 24 GPUs, but trainer.parallel gives tp\*pp\*dp = 2\*1\*8 = 16"),
        ("mixtral_8x7b", ["rollout.num_engines=2"],
         r"cluster.inference_nodes=2 x gpus_per_node=8 = 16 GPUs, but rollout.num_engines\*engine_tp\*engine_dp"),
        # One trainer node: experts not sharded by the optimizer (edp 1) and no TP for the logits.
        ("qwen3_30b_a3b", ["cluster.trainer_nodes=1", "trainer.parallel.tp=1"],
         r"trainer.parallel \(tp1-pp1-ep8-etp1-dp8\).*pipeline stage 0 needs .* GB per GPU .*more than"
         r" cluster.gpu_memory_gb = 80.0 \(h100\)"),
        # 8 engines of 8 GPUs cannot hold 1.3 TB of bf16 weights.
        ("deepseek_v3", ["rollout.num_engines=8", "rollout.engine_dp=1"],
         r"rollout.engine_tp=8, engine_dp=1, engine_ep=True, gpu_memory_utilization=0.85: weights .* not enough"),
        ("deepseek_v3", ["rollout.engine_dp=3", "rollout.num_engines=1", "cluster.inference_nodes=3"],
         r"rollout.engine_ep=true: the model's experts \(256\) are not divisible by engine_tp \* engine_dp = 24"),
        ("qwen3_30b_a3b", ["model.hf_config=configs/models/nope.json"], r"model.hf_config='configs/models/nope.json'"),
        ("quickstart", ["cluster.trainer_nodes=1"], r"cluster.trainer_nodes=1, cluster.inference_nodes=None: set both"),
    ],
)  # fmt: skip
def test_broken_configs_are_refused_naming_the_field(config, overrides, message):
    with pytest.raises(PlanError, match=message):
        plan(load_config(ROOT / "configs" / f"{config}.yaml", overrides))


def _mrl(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_plan_command_prints_one_json_object():
    result = _mrl("plan", "configs/deepseek_v3.yaml", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["family"] == "deepseek_v3" and report["gpu"] == "h200"
    assert report["trainer"]["gpus"] == 128 and report["inference"]["gpus"] == 64
    assert report["trainer"]["stage_layers"] == [5, 8, 8, 8, 8, 8, 8, 8]
    assert 0 < report["trainer"]["per_gpu_gb"]["total"] <= report["gpu_memory_gb"]
    assert report["params_b"]["total"] == pytest.approx(671, rel=0.02)


def test_plan_command_table_and_errors():
    table = _mrl("plan", "configs/mixtral_8x7b.yaml")
    assert table.returncode == 0, table.stderr[-2000:]
    assert "mixtral" in table.stdout and "tp2-pp2-ep8-etp1-dp4" in table.stdout and "KV cache" in table.stdout
    bad = _mrl("plan", "configs/mixtral_8x7b.yaml", "cluster.trainer_nodes=4")
    assert bad.returncode == 2
    assert "megatron-rl plan: error: cluster.trainer_nodes=4" in bad.stderr


def test_planner_imports_no_torch():
    code = "import sys, megatron_rl.planner; assert 'torch' not in sys.modules, 'planner imported torch'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT).returncode == 0


def test_checked_model_names_an_unknown_family_a_contradicted_one_and_a_layout_that_does_not_divide():
    """What `megatron-rl train` checks before anything starts (`launcher.prepare_run`), as `plan` does."""
    cfg = load_config("configs/quickstart.yaml", [])
    tiny = get_family("qwen3_moe").tiny_hf_config(TINY_VOCAB)
    assert checked_model(cfg, tiny).num_experts == 8
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(PlanError, match=r"^m/config.json: unknown architecture \['LlamaForCausalLM'\] / model_type"):
        checked_model(cfg, llama, "m/config.json")
    mixtral = load_config("configs/quickstart.yaml", ["model.family=mixtral"])
    with pytest.raises(
        PlanError,
        match=r"^model.family=mixtral, but m/config.json holds a qwen3_moe model \(set model.family=qwen3_moe,",
    ):
        checked_model(mixtral, tiny, "m/config.json")
    ep3 = load_config("configs/quickstart.yaml", ["trainer.parallel.ep=3"])
    with pytest.raises(PlanError, match=r"^trainer.parallel.ep=3: the model's experts \(8\) is not divisible by 3$"):
        checked_model(ep3, tiny)
