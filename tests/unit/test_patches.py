"""The Megatron-Core patches: applied by one call, idempotent, each doing what its docstring says.

Runs in a subprocess so that the patched torch.cuda does not leak into other tests. The parity tests in
tests/distributed exercise every patch end to end; the optimizer patches (and the shared-step fix, which needs a whole
DistributedOptimizer) are exercised by the train-step and resume tests in tests/distributed/test_train_step.py.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import psutil
import pytest

CHECK = r"""
import json, torch
from megatron_rl.parallel.patches import apply_patches
names = apply_patches()
again = apply_patches()
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import utils as tutils, torch_norm, multi_latent_attention
from megatron.core.transformer.moe import moe_utils
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.dot_product_attention import DotProductAttention
import inspect
out = {
    "names": names,
    "idempotent": names == again,
    "current_device": str(torch.cuda.current_device()),
    "schedule_zeros": str(schedules.torch.zeros([], device="cuda").device),
    "causal_mask": str(tutils.get_default_causal_mask(4).device),
    "te_gemm_defined": hasattr(moe_utils, "te_general_gemm") and moe_utils.te_general_gemm is None,
    "mla_have_te": multi_latent_attention.HAVE_TE,
    "dpa_takes_channels": "k_channels" in inspect.signature(DotProductAttention.__init__, follow_wrapped=False).parameters,
    "stream_noop": torch.cuda.current_stream() == torch.cuda.Stream(),
    "tensor_cuda": str(torch.ones(2).cuda().device),
}


def optimizer_checks():
    import types
    from megatron.core.optimizer import distrib_optimizer, optimizer as opt_mod
    cls = distrib_optimizer.DistributedOptimizer
    res = {"builder_is_classmethod": isinstance(cls.__dict__["_build_model_and_main_param_groups"], classmethod)}
    # clip_grad_by_total_norm_fp32 accepts CPU fp32 grads (it asserted a CUDA type) and restores Tensor.type.
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    opt_mod.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    res["clipped"] = round(float(p.grad[0]), 4)
    res["type_restored"] = torch.ones(1).type()
    # Loaded fully_reshardable tensors carry no 'step': the torch-AdamW state's own step is kept.
    main = torch.zeros(3)
    state = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        model_param_group_index_map={"w": (0, 0)},
        optimizer=types.SimpleNamespace(param_groups=[{"params": [main]}], state={main: state}),
    )
    cls._set_main_param_and_optimizer_states(fake, "w", {"param": torch.ones(3), "exp_avg": torch.full((3,), 2.0), "exp_avg_sq": torch.full((3,), 3.0)})
    res["set_states"] = [float(main[0]), float(state["exp_avg"][0]), float(state["exp_avg_sq"][0]), float(state["step"])]
    return res


def expert_bias_counts():
    import types
    from megatron.core.transformer.moe.router import TopKRouter
    router = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(3))
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    padding = torch.tensor([False, False, True, True, False])
    TopKRouter._apply_expert_bias(router, routing_map, padding_mask=padding)
    return router.local_tokens_per_expert.tolist()


def aux_loss_empty():
    from megatron.core.transformer.moe import moe_utils, router
    res = {}
    for name, total, valid in (("empty", 0.0, [False] * 4), ("real", 3.0, [True, True, True, False])):
        probs = torch.rand(4, 8, requires_grad=True)
        counts = torch.tensor([0.0] * 8) if total == 0 else torch.tensor([2.0, 1, 0, 1, 0, 1, 0, 1])
        kw = dict(topk=2, num_experts=8, moe_aux_loss_coeff=0.01, padding_mask=torch.tensor(valid))
        loss = router.switch_load_balancing_loss_func(probs, counts, torch.tensor(total), **kw)
        loss.backward()
        want = moe_utils.switch_load_balancing_loss_func(probs, counts, torch.tensor(max(total, 1.0)), **kw)
        res[name] = [float(loss), float(want), bool(torch.isfinite(probs.grad).all())]
    return res


def split_size_types():
    seen = {}
    def fake_all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
        seen["types"] = [type(output_split_sizes).__name__, type(input_split_sizes).__name__]
        out.copy_(inp)
    real, torch.distributed.all_to_all_single = torch.distributed.all_to_all_single, fake_all_to_all_single
    class G:
        def size(self): return 2
    try:
        mappings._AllToAll.apply(G(), torch.ones(3, 2), torch.tensor([1, 2]), torch.tensor([2, 1]))
    finally:
        torch.distributed.all_to_all_single = real
    return seen["types"]


def merged_dispatch():
    import types
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    calls = []
    def fake_all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
        calls.append(tuple(inp.shape))
        out.copy_(inp)
    class G:
        def size(self): return 2
    fake = types.SimpleNamespace(
        ep_size=2, ep_group=G(), output_splits=[2, 1], input_splits=[1, 2], tokens_per_expert=torch.tensor([3]),
        _maybe_dtoh_and_synchronize=lambda point, t: t,
    )
    real, torch.distributed.all_to_all_single = torch.distributed.all_to_all_single, fake_all_to_all_single
    res = {}
    try:
        tokens = torch.randn(3, 4, requires_grad=True)
        probs = torch.rand(3, requires_grad=True)
        got_tokens, got_probs = MoEAlltoAllTokenDispatcher.token_dispatch(fake, tokens, probs)
        (got_tokens.sum() * 2 + (got_probs * 3).sum()).backward()
        res["fp32_calls"] = calls[:]
        res["fp32_equal"] = torch.equal(got_tokens, tokens) and torch.equal(got_probs, probs)
        res["fp32_grads"] = [float(tokens.grad.min()), float(tokens.grad.max()), float(probs.grad.min()), float(probs.grad.max())]
        calls.clear()
        MoEAlltoAllTokenDispatcher.token_dispatch(fake, torch.randn(3, 4, dtype=torch.bfloat16), torch.rand(3))
        res["mixed_calls"] = calls[:]
    finally:
        torch.distributed.all_to_all_single = real
    return res


# One process for every Megatron-side check: each import of Megatron costs seconds.
out["optimizer"] = optimizer_checks()
out["expert_bias_counts"] = expert_bias_counts()
out["aux_loss_empty"] = aux_loss_empty()
out["split_types"] = split_size_types()
out["merged_dispatch"] = merged_dispatch()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def patched():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_all_patches_applied_once(patched):
    assert set(patched["names"]) == {
        "torch_cuda_shims",
        "rng_tracker",
        "literal_cuda_devices",
        "param_type_names",
        "optimizer_state_step_key",
        "optimizer_shared_step_tensor",
        "torch_norm_sequence_parallel",
        "all_to_all_split_lists",
        "merged_dispatch_all_to_all",
        "moe_utils_te_names",
        "local_attention_mla_channels",
        "mla_have_te_flag",
        "expert_bias_padding_mask",
        "aux_loss_empty_micro_batch",
        "gloo_group_timeout",
        "write_results_queue_lifetime",
    }
    assert patched["idempotent"]


def test_cuda_devices_become_cpu(patched):
    assert patched["current_device"] == "cpu"
    assert patched["schedule_zeros"] == "cpu"
    assert patched["causal_mask"] == "cpu"
    assert patched["stream_noop"]
    assert patched["tensor_cuda"] == "cpu"


def test_te_fallbacks(patched):
    assert patched["te_gemm_defined"]
    assert patched["mla_have_te"] is False
    assert patched["dpa_takes_channels"]


def test_split_sizes_become_lists(patched):
    assert patched["split_types"] == ["list", "list"]


def test_dispatch_sends_fp32_tokens_and_probs_in_one_all_to_all(patched):
    out = patched["merged_dispatch"]
    # fp32: one call with the probabilities as a fifth column, both come back intact, both get their gradients
    # (the backward is one all-to-all too: the fake counts it).
    assert out["fp32_calls"] == [[3, 5], [3, 5]]
    assert out["fp32_equal"]
    assert out["fp32_grads"] == [2.0, 2.0, 3.0, 3.0]
    # bf16 tokens with fp32 probabilities: Megatron's two calls, nothing cast.
    assert out["mixed_calls"] == [[3, 4], [3]]


def test_optimizer_patches(patched):
    out = patched["optimizer"]
    assert out["builder_is_classmethod"]
    assert out["clipped"] == 0.5
    assert out["type_restored"] == "torch.FloatTensor"
    assert out["set_states"] == [1.0, 2.0, 3.0, 5.0]


def test_expert_bias_counts_leave_padding_out(patched):
    """megatron-core 0.16.1 broadcast the [tokens] padding mask along the experts of the [tokens, experts] map."""
    assert patched["expert_bias_counts"] == [1.0, 2.0, 3.0]


def test_an_all_padding_micro_batch_adds_a_zero_load_balancing_loss(patched):
    """megatron-core 0.16.1 divided by the micro-batch's real token count: 0 * inf, a NaN in every router's
    gradient, for the empty micro-batches a replica with fewer packed rows runs. Real tokens: the same value."""
    empty, real = patched["aux_loss_empty"]["empty"], patched["aux_loss_empty"]["real"]
    assert empty == [0.0, 0.0, True]
    assert real[0] == pytest.approx(real[1], rel=1e-6) and real[0] > 0 and real[2]


WRITER_MANAGER_PROBE = r"""
import time
from megatron_rl.parallel.patches import apply_patches
apply_patches()
from megatron.core.dist_checkpointing.strategies import filesystem_async
queue = filesystem_async._get_write_results_queue()
queue.put({0: "written"})
assert queue.get(timeout=30) == {0: "written"} and filesystem_async._get_write_results_queue() is queue
print("ready", flush=True)
time.sleep(600)
"""


def test_the_checkpoint_writers_manager_ends_with_the_rank_that_started_it():
    """Megatron's writer spawns a Manager server at a rank's first save; a rank killed outright must not leave it
    running (before the patch it lived on, re-parented to init)."""
    rank = subprocess.Popen([sys.executable, "-c", WRITER_MANAGER_PROBE], stdout=subprocess.PIPE, text=True)
    servers: list[psutil.Process] = []
    try:
        assert rank.stdout.readline().strip() == "ready", rank.communicate(timeout=60)
        children = psutil.Process(rank.pid).children()
        servers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(servers) == 1, [c.cmdline() for c in children]  # the Manager's server, the queue working
        rank.kill()
        rank.wait(30)
        _, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, "the Manager's server outlived its rank"
    finally:
        for process in [*servers, rank]:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                process.kill()
