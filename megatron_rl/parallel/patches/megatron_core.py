"""Megatron-Core's patches: fixes needed on any device, and what it needs to run on CPU with gloo.

Applied by `apply_patches()`, idempotent: the device-independent fixes always, the CPU patches only when CUDA is
unavailable (checked on megatron-core 0.16.1, torch 2.13.0+cpu). Each names the failure it fixes and the versions
checked. Each imports what it patches when it is applied (see the package docstring).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import inspect
import multiprocessing.managers
import os
import threading
import types

import torch

from megatron_rl.parallel.patches.torch_distributed import apply_torch_patches
from megatron_rl.parallel.processes import die_with_parent

_APPLIED: list[str] = []


def applied_patches() -> list[str]:
    """Names of the patches applied in this process (on GPU only the device-independent fixes)."""
    return list(_APPLIED)


class _NullStream:
    """Stands in for torch.cuda.Stream/Event on CPU: work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


def _patch_torch_cuda_shims() -> None:
    """Failure: Megatron calls `torch.cuda.current_device()` as a device, `torch.cuda.synchronize()` in the p2p
    pipeline code, `torch.cuda.Stream()/stream()/current_stream()` in the MoE alltoall dispatcher, and
    `tensor.cuda()` (tied output layer on the last pipeline stage in `language_module.py`, the distributed
    optimizer's gather); all raise "Torch not compiled with CUDA enabled". On a CPU-only process these become
    the CPU device and no-ops."""
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *a, **k: self


def _patch_rng_tracker() -> None:
    """Failure: `model_parallel_cuda_manual_seed` -> `CudaRNGStatesTracker.add` calls `torch.cuda.get_rng_state()`
    and `_set_cuda_rng_state` touches CUDA generators. On CPU the tracker forks the CPU generator instead, which
    keeps Megatron's per-TP-rank initialisation streams distinct."""
    from megatron.core.tensor_parallel import random as mrandom  # at apply time (see the module docstring)

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)


class _CpuTorchProxy(types.ModuleType):
    """`torch` as seen by one module, with `device="cuda"` in tensor factories turned into the CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "randn", "rand", "randint", "eye", "as_tensor")

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:

            @functools.wraps(attr)
            def factory(*args, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)

            return factory
        return attr


# Modules that create tensors with a literal device="cuda" on the paths this project runs.
_LITERAL_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # token count zeros in every forward-backward function
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.transformer.utils",  # get_default_causal_mask
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def _patch_literal_cuda_devices() -> None:
    """Failure: these modules create tensors with a literal `device="cuda"` (the token count in
    `schedules.py`, the causal mask in `transformer/utils.py`, the grad-norm buffers in `clip_grads.py`, ...):
    "Torch not compiled with CUDA enabled". Each module's `torch` name is replaced by a proxy that maps
    `device="cuda"` in tensor factories to the CPU."""

    proxy = _CpuTorchProxy()
    for name in _LITERAL_CUDA_MODULES:
        importlib.import_module(name).torch = proxy


def _wrap_method(cls, name: str, wrap) -> None:
    """Replace `cls.name` by `wrap(function)`, keeping a staticmethod/classmethod descriptor what it was."""
    attr = cls.__dict__.get(name)
    if isinstance(attr, (staticmethod, classmethod)):
        setattr(cls, name, type(attr)(wrap(attr.__func__)))
    elif attr is not None:
        setattr(cls, name, wrap(attr))


def _patch_param_type_names() -> None:
    """Failure: Megatron's optimizers check `param.type()` against 'torch.cuda.FloatTensor' (and Half/BFloat16):
    the DistributedOptimizer's builders and `Float16OptimizerWithFloat16Params.__init__` raise "Wrapped
    parameters must be one of torch.cuda.FloatTensor ...", and `clip_grad_by_total_norm_fp32` asserts
    `param.grad.type() == 'torch.cuda.FloatTensor'` (AssertionError at the first step with clip_grad > 0).
    While those functions run, `Tensor.type()` without arguments reports CPU tensors under their CUDA names.
    `_build_model_and_main_param_groups` is a classmethod in 0.16.1 (a staticmethod elsewhere): the wrapper keeps
    the descriptor. The wrappers nest (the builder runs inside `__init__`), so each restores what it found."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer  # at apply time (module docstring)

    original_type = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        result = original_type(self, *args, **kwargs)
        if (
            not args
            and not kwargs
            and isinstance(result, str)
            and result.startswith("torch.")
            and ".cuda." not in result
        ):
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    def with_cuda_names(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            previous = torch.Tensor.type
            torch.Tensor.type = cuda_named_type
            try:
                return fn(*args, **kwargs)
            finally:
                torch.Tensor.type = previous

        return wrapper

    for name in ("_build_model_and_main_param_groups", "__init__"):
        _wrap_method(distrib_optimizer.DistributedOptimizer, name, with_cuda_names)
    _wrap_method(optimizer.Float16OptimizerWithFloat16Params, "__init__", with_cuda_names)
    # optimizer.py imported the function by name: patch both references.
    clipped = with_cuda_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clipped
    optimizer.clip_grad_by_total_norm_fp32 = clipped


def _patch_optimizer_state_step_key() -> None:
    """Failure: without Apex or Transformer Engine (always on CPU) the optimizer is torch's AdamW, which keeps a
    `step` tensor in every parameter's state. Loading a DistributedOptimizer checkpoint saved as
    `fully_reshardable` copies every key of that state from the loaded tensors, which carry no `step` (Megatron
    restores it from the parameter groups): "KeyError: 'step'" in `_set_main_param_and_optimizer_states`
    (megatron-core 0.16.1). The already-restored `step` is passed through as its own source."""
    from megatron.core.optimizer import distrib_optimizer  # at apply time (see the module docstring)

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state.get(main_param, {})
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states


def _patch_optimizer_shared_step_tensor() -> None:
    """Failure: without Apex or Transformer Engine (always on CPU) `DistributedOptimizer.load_state_dict` gives
    every parameter's torch-AdamW state the *same* `step` tensor. AdamW increments `step` in place per
    parameter, so after a resume the shared counter advances once per parameter in the first step and the bias
    corrections go wrong: the resumed update differed by up to 0.22 in logprobs from an uninterrupted run while
    loss, grad norm and every loaded state tensor matched (megatron-core 0.16.1; its non-distributed optimizers
    deep-copy the step). Each parameter gets its own copy after loading."""
    from megatron.core.optimizer import distrib_optimizer  # at apply time (see the module docstring)

    cls = distrib_optimizer.DistributedOptimizer
    original = cls.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()
        return result

    cls.load_state_dict = load_state_dict


def _patch_torch_norm_sequence_parallel() -> None:
    """Failure: the torch-norm fallback (`WrappedTorchNorm`, used without Transformer Engine) asserts
    `not config.sequence_parallel`, but MoE with TP > 1 requires sequence parallelism. The norm itself is
    position-wise, so it is correct on a sequence shard; its weights are marked `sequence_parallel` so that
    Megatron all-reduces their gradients across the tensor parallel group, as it does for TE norms."""
    from megatron.core.transformer import torch_norm  # at apply time (see the module docstring)

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _patch_all_to_all_split_lists() -> None:
    """Failure: the MoE alltoall dispatcher passes its split sizes as CPU tensors; gloo's `all_to_all_single`
    accepts only lists of ints ("split sizes must be a list"). The sizes are converted before the call."""
    from megatron.core.tensor_parallel import mappings  # at apply time (see the module docstring)

    original = mappings._AllToAll.forward

    def as_list(sizes):
        return sizes.tolist() if hasattr(sizes, "tolist") else sizes

    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        return original(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(forward)


def _patch_merged_dispatch_all_to_all() -> None:
    """Cost, not a failure (megatron-core 0.16.1): the alltoall dispatcher sends the permuted tokens and their
    routing probabilities in two all-to-alls with the same splits, so every MoE layer costs two extra collectives
    a step (the second in backward too), each a point where the EP ranks wait for each other: on gloo these
    latencies, not the bytes, take the time at small batches. When both have one dtype (fp32 training) the
    probabilities travel as one more column of the tokens: one all-to-all forward and one backward, the same
    values and gradients. Other dtypes (bf16 tokens, fp32 probabilities) keep Megatron's two calls."""
    from megatron.core.transformer.moe import token_dispatcher  # at apply time (see the module docstring)

    def wrap(original):
        def token_dispatch(self, tokens, probs):
            if self.ep_size == 1 or probs is None or probs.dtype != tokens.dtype or probs.shape != tokens.shape[:-1]:
                return original(self, tokens, probs)
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
            both = torch.cat([tokens, probs.unsqueeze(-1)], dim=-1)
            both = token_dispatcher.all_to_all(self.ep_group, both, self.output_splits, self.input_splits)
            return both[..., :-1], both[..., -1]

        return token_dispatch

    _wrap_method(token_dispatcher.MoEAlltoAllTokenDispatcher, "token_dispatch", wrap)


def _patch_moe_utils_te_names() -> None:
    """Failure (megatron-core 0.16.1; fixed later): without Transformer Engine, `moe_utils` never defines
    `te_general_gemm` and the other fused TE names, but `RouterGatingLinearFunction` tests
    `te_general_gemm is not None` -> NameError in every MoE router forward. Define the missing names as None,
    which selects Megatron's own torch fallbacks."""
    from megatron.core.transformer.moe import moe_utils  # at apply time (see the module docstring)

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch_local_attention_mla_channels() -> None:
    """Failure: multi-latent attention passes `k_channels`/`v_channels` to its core attention; the local
    `DotProductAttention` (the only one without Transformer Engine) rejects them: "TypeError: __init__() got an
    unexpected keyword argument 'k_channels'". It already handles a query/key width that differs from the value
    width (it reshapes with -1); only its output width must become heads x v_channels."""
    from megatron.core.transformer import dot_product_attention  # at apply time (see the module docstring)

    cls = dot_product_attention.DotProductAttention
    original_init = cls.__init__

    @functools.wraps(original_init)
    def init(self, *args, k_channels=None, v_channels=None, **kwargs):
        original_init(self, *args, **kwargs)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    cls.__init__ = init


def _patch_mla_have_te_flag() -> None:
    """Failure: `multi_latent_attention.HAVE_TE` is True without Transformer Engine installed (a mock stands in
    for the TE classes), so `isinstance(self.linear_proj, TELinear)` raises "isinstance() arg 2 must be a type".
    Without CUDA the TE path can never be taken: set the flag to its true value."""
    from megatron.core.transformer import multi_latent_attention  # at apply time (see the module docstring)

    multi_latent_attention.HAVE_TE = False


def _patch_expert_bias_padding_mask() -> None:
    """Failure (any device): `TopKRouter._apply_expert_bias` masks the `[tokens, experts]` routing map with the
    flattened `[tokens]` padding mask (`routing_map & (~padding_mask)`), which broadcasts along the experts
    instead of the tokens: it raises for any batch whose token count differs from the number of experts, and
    silently miscounts when they are equal. So a router with expert bias (DeepSeek-V3) could not be given the
    padding mask, and counted padding tokens in its bias update. Fix: give the mask its experts dimension.
    megatron-core 0.16.1.
    """
    from megatron.core.transformer.moe.router import TopKRouter  # at apply time (see the module docstring)

    def wrap(original):
        @functools.wraps(original)
        def _apply_expert_bias(self, routing_map, padding_mask=None):
            if padding_mask is not None and padding_mask.dim() == routing_map.dim() - 1:
                padding_mask = padding_mask.unsqueeze(-1)
            return original(self, routing_map, padding_mask=padding_mask)

        return _apply_expert_bias

    _wrap_method(TopKRouter, "_apply_expert_bias", wrap)


def _patch_aux_loss_empty_micro_batch() -> None:
    """Failure (any device): with the padding mask the routers' load-balancing loss divides by the micro-batch's
    real token count (`get_tokens_per_expert_and_token_count` sums the routing map), so a micro-batch of padding
    only (a replica whose sequences pack into fewer rows than another's runs empty ones, since every replica
    runs as many micro-batches as the one that needs the most) gives `0 * inf`: a NaN gradient in every router,
    and the guard skips the whole update. Fix: the denominator is at least 1, so such a micro-batch adds a zero
    loss, as z-loss already does (`z_loss_func` clamps its count). megatron-core 0.16.1.
    """
    from megatron.core.transformer.moe import router  # at apply time (see the module docstring)

    original = router.switch_load_balancing_loss_func

    @functools.wraps(original)
    def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, *args, **kwargs):
        if isinstance(total_num_tokens, torch.Tensor):
            total_num_tokens = total_num_tokens.clamp(min=1)
        else:
            total_num_tokens = max(total_num_tokens, 1)
        return original(probs, tokens_per_expert, total_num_tokens, *args, **kwargs)

    router.switch_load_balancing_loss_func = switch_load_balancing_loss_func


def _patch_gloo_group_timeout() -> None:
    """Failure (any device): `initialize_model_parallel` creates EXPERT_DATA_PARALLEL_GROUP_GLOO without the
    `timeout` it gives every other group, so torch's `new_group` gives it 30 minutes whatever
    `distributed_timeout_minutes` says: a peer gone while the distributed optimizer gathers expert state over it (a
    checkpoint save) held the others 30 minutes, not trainer.timeout_s + 120 s. Fix: a group made inside
    `initialize_model_parallel` without a timeout gets the call's. megatron-core 0.16.1, torch 2.13.0.
    """
    from megatron.core import parallel_state  # at apply time (see the module docstring)

    initialize, create = parallel_state.initialize_model_parallel, parallel_state.create_group
    if "distributed_timeout_minutes" not in inspect.signature(initialize).parameters:
        raise RuntimeError("gloo_group_timeout: this megatron-core's initialize_model_parallel has no timeout argument")
    within: list[datetime.timedelta] = []  # the timeout of the initialize_model_parallel call running

    @functools.wraps(initialize)
    def initialize_model_parallel(*args, **kwargs):
        bound = inspect.signature(initialize).bind(*args, **kwargs)
        bound.apply_defaults()
        within.append(datetime.timedelta(minutes=bound.arguments["distributed_timeout_minutes"]))
        try:
            return initialize(*args, **kwargs)
        finally:
            within.pop()

    @functools.wraps(create)
    def create_group(ranks=None, timeout=None, *args, **kwargs):
        return create(ranks, timeout if timeout is not None or not within else within[-1], *args, **kwargs)

    parallel_state.initialize_model_parallel = initialize_model_parallel
    parallel_state.create_group = create_group


def _patch_write_results_queue_lifetime() -> None:
    """Failure (any device): Megatron's checkpoint writer takes its results queue from a `multiprocessing` Manager
    whose server process it spawns at a rank's first save (`filesystem_async._get_write_results_queue`) and which
    ends only when the rank exits normally: a rank killed (SIGKILL, the OOM killer) leaves it running for ever,
    re-parented to init (found after the fault tests, one per killed run). Fix: the same Manager, its server
    started with a parent-death signal (`die_with_parent`) when the rank's main thread starts it (the signal comes
    when the starting thread ends; from another thread it starts as before). megatron-core 0.16.1, Python 3.11.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # at apply time

    original = filesystem_async._get_write_results_queue

    @functools.wraps(original)
    def _get_write_results_queue():
        if filesystem_async._results_queue is None and threading.current_thread() is threading.main_thread():
            manager = multiprocessing.managers.SyncManager(ctx=torch.multiprocessing.get_context("spawn"))
            manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
            filesystem_async._results_queue = manager.Queue()  # the proxy holds the manager, as Megatron's does
        return original()

    filesystem_async._get_write_results_queue = _get_write_results_queue


_ALL_DEVICES = (
    _patch_expert_bias_padding_mask,
    _patch_aux_loss_empty_micro_batch,
    _patch_gloo_group_timeout,
    _patch_write_results_queue_lifetime,
)
"""Fixes of Megatron-Core itself, applied on every device."""

_CPU_ONLY = (
    _patch_torch_cuda_shims,
    _patch_rng_tracker,
    _patch_literal_cuda_devices,
    _patch_param_type_names,
    _patch_optimizer_state_step_key,
    _patch_optimizer_shared_step_tensor,
    _patch_torch_norm_sequence_parallel,
    _patch_all_to_all_split_lists,
    _patch_merged_dispatch_all_to_all,
    _patch_moe_utils_te_names,
    _patch_local_attention_mla_channels,
    _patch_mla_have_te_flag,
)
"""What Megatron-Core needs to run on CPU with gloo; not applied when CUDA is available."""


def apply_patches() -> list[str]:
    """Apply every patch once: torch's (`torch_distributed.py`, listed by `applied_torch_patches()`), the
    device-independent fixes, and the CPU patches when CUDA is unavailable; return the Megatron-Core names applied
    in this process."""
    apply_torch_patches()
    if _APPLIED:
        return applied_patches()
    patches = _ALL_DEVICES + (() if torch.cuda.is_available() else _CPU_ONLY)
    for patch in patches:
        patch()
        _APPLIED.append(patch.__name__.removeprefix("_patch_"))
    return applied_patches()
