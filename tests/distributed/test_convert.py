"""Checkpoint conversion with real gloo processes: round trip, cross-layout load, and bad input."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.models.base import CheckpointError, ParamRule
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.parallel.layout import LayoutError, ParallelLayout
from megatron_rl.parallel.torchrun import LaunchError
from megatron_rl.trainer.hf_weights import build_local_tensor, read_direct
from megatron_rl.verify.parity import hf_logprobs, megatron_logprobs, parity_tokens
from megatron_rl.verify.roundtrip import compare_hf_checkpoints
from megatron_rl.weights.convert import hf_to_mcore, mcore_to_hf


@pytest.fixture(scope="module")
def mcore_tp2_pp2_ep2(tiny_dir, tmp_path_factory):
    """The tiny Qwen3-MoE converted at TP2xPP2xEP2 (4 processes)."""
    out = tmp_path_factory.mktemp("conv") / "mcore"
    report = hf_to_mcore(tiny_dir("qwen3_moe"), str(out), ParallelLayout(tp=2, pp=2, ep=2))
    assert report["layout"] == "tp2-pp2-ep2-etp1-dp1"
    # The in-process writer: one file per rank, each written by its rank.
    assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert report["convert_seconds"] > 0 and report["startup_seconds"] > 0
    return out


def test_round_trip_is_bit_identical(mcore_tp2_pp2_ep2, tiny_dir, tmp_path):
    """HF -> Megatron at TP2xPP2xEP2 -> HF (gathered at another layout): same names, shapes, dtypes, bits."""
    back = tmp_path / "hf"
    mcore_to_hf(str(mcore_tp2_pp2_ep2), str(back), ParallelLayout(pp=2, ep=2))
    report = compare_hf_checkpoints(tiny_dir("qwen3_moe"), str(back))
    assert report["identical"], report
    assert report["tensors"] == 69
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(back)).model_type == "qwen3_moe"


@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_round_trip_other_families(family, tiny_dir, tmp_path):
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    hf_to_mcore(tiny_dir(family), str(mcore), ParallelLayout(tp=2, ep=2))
    mcore_to_hf(str(mcore), str(back), ParallelLayout(pp=2))
    report = compare_hf_checkpoints(tiny_dir(family), str(back))
    assert report["identical"], report


@pytest.mark.slow  # the default suite has both halves: round trips gathered at another layout, bit-identical
# (above), and trainer checkpoints resumed at another layout (test_train_step.py::test_resume_at_another_layout)
def test_saved_at_one_layout_loads_at_another(tiny_dir, tmp_path):
    """Saved at TP2xPP2, loaded at EP2: the same logprobs as loading the HF weights directly."""
    hf = tiny_dir("qwen3_moe")
    mcore = tmp_path / "mcore"
    hf_to_mcore(hf, str(mcore), ParallelLayout(tp=2, pp=2))
    tokens = parity_tokens(512, 4, 160)
    from_mcore, _ = megatron_logprobs(hf, ParallelLayout(ep=2), tokens, mcore_dir=str(mcore))
    from_hf, _ = megatron_logprobs(hf, ParallelLayout(ep=2), tokens)
    reference = hf_logprobs(hf, tokens)
    assert torch.allclose(from_mcore, from_hf, atol=1e-6, rtol=0)
    assert (from_mcore - reference).abs().max() <= 1e-4


def test_parity_detects_a_changed_expert(tiny_dir, tmp_path):
    """The parity check can fail: one expert's weights changed on the HF side only."""
    hf = Path(tiny_dir("qwen3_moe"))
    mcore = tmp_path / "mcore"
    hf_to_mcore(str(hf), str(mcore), ParallelLayout())
    changed = tmp_path / "changed"
    shutil.copytree(hf, changed)
    tensors = load_file(changed / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    tokens = parity_tokens(512, 4, 160)
    from_mcore, _ = megatron_logprobs(str(changed), ParallelLayout(), tokens, mcore_dir=str(mcore))
    assert (from_mcore - hf_logprobs(changed, tokens)).abs().max() > 1e-4


def _corrupt_copy(src: str, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"),
            "1 missing tensor\\(s\\): model.layers.0.self_attn.k_proj.weight",
        ),
        (
            lambda t: t.__setitem__("model.layers.0.extra.weight", torch.ones(2)),
            "1 unexpected tensor\\(s\\): model.layers.0.extra.weight",
        ),
        (  # an FP8 checkpoint's block scales beside its weights
            lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(1, 1)),
            "unexpected tensor\\(s\\): model.layers.0.self_attn.q_proj.weight_scale_inv; a quantized checkpoint: "
            "dequantize it to bfloat16 or float32 first",
        ),
        (  # it was cast and converted without a word (values changed)
            lambda t: t.__setitem__(
                "model.layers.0.self_attn.q_proj.weight", t["model.layers.0.self_attn.q_proj.weight"].to(torch.int32)
            ),
            "tensor model.layers.0.self_attn.q_proj.weight is stored as int32, not float32 / bfloat16 / float16 / "
            "float64; a quantized checkpoint",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.0.self_attn.q_proj.weight",
                t["model.layers.0.self_attn.q_proj.weight"].to(torch.float8_e4m3fn),
            ),
            "tensor model.layers.0.self_attn.q_proj.weight is stored as f8_e4m3",
        ),
    ],
    ids=["missing", "extra", "fp8-scales", "int32", "fp8"],
)
def test_bad_tensor_names_fail_before_launch(edit, message, tiny_dir, tmp_path):
    bad = _corrupt_copy(tiny_dir("qwen3_moe"), tmp_path / "bad", edit)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=message):
        hf_to_mcore(str(bad), str(out), ParallelLayout())
    assert not out.exists()
    assert not any(p.name.startswith(".out.partial") for p in tmp_path.iterdir())


def test_wrong_shape_is_named_and_leaves_no_output(tiny_dir, tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    bad = _corrupt_copy(tiny_dir("qwen3_moe"), tmp_path / "bad", lambda t: t.__setitem__(name, torch.ones(3, 128)))
    out = tmp_path / "out"
    with pytest.raises(LaunchError, match=name):
        hf_to_mcore(str(bad), str(out), ParallelLayout(ep=2))
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]


def test_unknown_architecture(tiny_dir, tmp_path):
    bad = Path(shutil.copytree(tiny_dir("qwen3_moe"), tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    config.update(architectures=["FancyNewForCausalLM"], model_type="fancy")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unknown architecture \\['FancyNewForCausalLM'\\]"):
        hf_to_mcore(str(bad), str(tmp_path / "out"), ParallelLayout())
    assert not (tmp_path / "out").exists()


def test_invalid_layout(tiny_dir, tmp_path):
    with pytest.raises(LayoutError, match="experts \\(8\\) is not divisible by 3"):
        hf_to_mcore(tiny_dir("qwen3_moe"), str(tmp_path / "out"), ParallelLayout(ep=3, dp=3))
    assert not (tmp_path / "out").exists()


def test_unreadable_file(tiny_dir, tmp_path):
    bad = Path(shutil.copytree(tiny_dir("qwen3_moe"), tmp_path / "bad"))
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable safetensors file"):
        hf_to_mcore(str(bad), str(tmp_path / "out"), ParallelLayout())
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: unreadable config.json"):
        hf_to_mcore(str(bad), str(tmp_path / "out"), ParallelLayout())
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        hf_to_mcore(tiny_dir("qwen3_moe"), str(out), ParallelLayout())
    assert (out / "keep.txt").read_text() == "mine"


def test_not_a_distributed_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a megatron-rl distributed checkpoint"):
        mcore_to_hf(str(tmp_path), str(tmp_path / "out"))


def test_hf_checkpoint_reads_match_safetensors(tmp_path):
    """Positioned reads give what safetensors gives, for every dtype and odd shapes (0-d, empty); dtypes it does
    not decode itself (fp8) go through safetensors; row reads refuse what they cannot do, reading nothing."""
    from safetensors import safe_open

    tensors = {
        "bf16": torch.randn(3, 5).bfloat16(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "int": torch.arange(7),
        "half": torch.randn(4, 3, 2).half(),
        "bool": torch.tensor([True, False]),
        "fp8": torch.randn(2, 2).to(torch.float8_e4m3fn),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt, reference = HFCheckpoint(tmp_path), safe_open(str(tmp_path / "model.safetensors"), "pt")
    for name in tensors:
        got, want = ckpt.get(name), reference.get_tensor(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.dim() else got == want, name
    rows = torch.full((2, 5), -1.0, dtype=torch.bfloat16)
    assert ckpt.read_rows_into("bf16", rows, 1) and torch.equal(rows, tensors["bf16"][1:3])
    assert not ckpt.read_rows_into("bf16", rows, 2)  # past the end
    assert not ckpt.read_rows_into("bf16", torch.empty(2, 5), 0)  # other dtype
    assert not ckpt.read_rows_into("bf16", torch.empty(2, 4, dtype=torch.bfloat16), 0)  # other width
    assert not ckpt.read_rows_into("fp8", torch.empty(1, 2, dtype=torch.float8_e4m3fn), 0)
    assert ckpt.layout_of("half") == ((4, 3, 2), torch.float16) and ckpt.layout_of("fp8") is None


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_direct_read_equals_general_path(tp_rank, tmp_path):
    """The direct row reads give the same shard as building the full tensor and cutting it (gate/up fused and
    split per TP rank); transforms and splits it does not handle are left to the general path."""
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    save_file({"gate": gate, "up": up, "qkv": torch.randn(4, 4)}, tmp_path / "model.safetensors")
    ckpt = HFCheckpoint(tmp_path)
    layout = types.SimpleNamespace(tp=2, etp=1)
    ctx = types.SimpleNamespace(layout=layout, tp_rank=tp_rank, etp_rank=0)
    rule = ParamRule(mcore="fc1", hf=("gate", "up"), transform="gate_up", tp_dim=0, tp_chunks=2)
    target = torch.empty(8, 3)
    assert read_direct(ckpt, rule, target, ctx)
    assert torch.equal(target, build_local_tensor(ckpt, rule, None, ctx))
    split_cols = ParamRule(mcore="proj", hf=("gate",), tp_dim=1)
    assert not read_direct(ckpt, split_cols, torch.empty(8, 1), ctx)
    assert not read_direct(ckpt, ParamRule(mcore="x", hf=("gate",)), torch.empty(8, 3, dtype=torch.bfloat16), ctx)
    assert not read_direct(ckpt, ParamRule(mcore="x", hf=("gate",)), torch.empty(7, 3), ctx)  # wrong shape
