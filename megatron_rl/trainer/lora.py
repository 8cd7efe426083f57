"""LoRA adapters on this rank's Megatron-Core GPTModel, laid out over tensor and expert parallelism as the base
layers are (names, shard rules and shapes: `models/lora.py`; the user's view: docs/lora.md).

`add_lora(model, cfg, family, arch, ctx, seed)` freezes every base parameter and puts a `LoraAdapter` beside each
targeted linear `X` (as the module `X_lora`, so the base's own names, checkpoint keys and weight map stay as they
are); a forward hook on `X` adds `scale * B A x` to its output. Only the adapters require gradients, so Megatron's
DDP buckets, the gradient reduction, the (distributed) optimizer and the gradient norm see nothing else.

How the delta follows the base layer's communication (`tp` = the layer's tensor-parallel group, ETP for experts):
- column-parallel (linear_qkv, linear_fc1): A [r, in] whole, B [out/tp, r] the base's output rows. With sequence
  parallelism the input is this rank's sequence slice: `u = x A^T` is all-gathered over the sequence (r columns,
  not the h the base gathers), then `u B^T` is this rank's output columns. A's gradient is then a partial sum
  over sequence slices, which Megatron all-reduces over TP at the end of the step (`sequence_parallel` mark,
  as for the norms). Without sequence parallelism `u` goes through the copy-to-TP region instead (gradient
  all-reduced in backward).
- row-parallel (linear_proj, linear_fc2): A [r, in/tp] on the base's input columns, B [out, r] whole: the partial
  `x_local A_local^T` of every TP rank is summed as the base's partial products are (reduce-scatter over the
  sequence with sequence parallelism, all-reduce without), then multiplied by B; B's gradient under sequence
  parallelism is a partial sum over sequence slices, all-reduced like A's above.
- routed experts (SequentialMLP's local experts, one pair each, held by the expert's EP rank): the token
  dispatcher does the communication of expert layers, so the delta is local; with expert tensor parallelism > 1
  every ETP rank computes its share of the same tokens, and the pair's unsplit tensor (A of fc1, B of fc2)
  gets its gradient summed over the ETP group in backward. Expert adapters go to DDP's expert buckets
  (`allreduce = False`, as `optimizer.mark_expert_params` does for the base experts).

Initialisation is layout-independent: each adapter's full A (kaiming-uniform, peft's default for `lora_A`) is drawn
from a generator seeded by the run seed and the adapter's canonical name, then cut to this rank's shard; B is 0, so
the adapted model starts equal to the base.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from torch import Tensor

from megatron_rl.config import LoraConfig
from megatron_rl.errors import UserError
from megatron_rl.models import ModelArch, ModelFamily, ParamRule, sharding
from megatron_rl.models.lora import ADAPTER_SUFFIX, AdapterRules, adapter_rule_table
from megatron_rl.models.naming import canonical_name
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.parallel.layout import rank_coords
from megatron_rl.trainer.hf_weights import local_offsets, tp_coords, uses_te_spec

LORA_PARAMS = ("lora_A", "lora_B")
"""The parameter names of an adapter module."""


class LoraError(UserError, ValueError):
    """A model or layout the adapters cannot be put on; names the layer and the setting."""


class LoraAdapter(torch.nn.Module):
    """The LoRA pair beside one Megatron linear: `lora_A` [r, in(/tp)], `lora_B` [out(/tp), r]; `forward(x)` is
    the delta `scale * B A x` in the base layer's output layout."""

    def __init__(self, base, rules: AdapterRules, rank: int, scale: float, dropout: float):
        super().__init__()
        self.rules, self.scale, self.active = rules, scale, True
        self.column_parallel = rules.column_parallel
        self.tp_group = base.tp_group
        self.tp_size = base.tp_group.size()
        # Expert layers leave their communication to the token dispatcher; a group of one needs none.
        self.local_only = self.tp_size == 1 or bool(getattr(base, "explicit_expert_comm", False))
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.local_only
        out_local, in_local = base.weight.shape
        kwargs = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, in_local, **kwargs))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, **kwargs))
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self._mark_parameters(is_expert=rules.base.is_expert)

    @property
    def full_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(A's, B's) unsharded shapes."""
        (r, a_in), (b_out, _) = self.lora_A.shape, self.lora_B.shape
        if self.column_parallel:
            return (r, a_in), (b_out * self.tp_size, r)
        return (r, a_in * self.tp_size), (b_out, r)

    def _mark_parameters(self, is_expert: bool) -> None:
        """Megatron's parameter attributes: TP split (for the gradient norm and checkpoints), the end-of-step TP
        all-reduce of the whole tensor's gradient under sequence parallelism, and the expert buckets."""
        split, whole = (self.lora_B, self.lora_A) if self.column_parallel else (self.lora_A, self.lora_B)
        tensor_parallel.set_tensor_model_parallel_attributes(split, True, 0 if self.column_parallel else 1, 1)
        # The norm counts a tensor not marked TP-split on dense TP rank 0 only. An expert's pair lives on its EP
        # rank, which can be any dense TP rank, so the whole tensor counts where its ETP rank is 0 (with ETP
        # dividing TP, the other ETP ranks are never dense TP rank 0).
        whole.tensor_model_parallel = is_expert and self.tp_group.rank() == 0
        if self.sequence_parallel:
            whole.sequence_parallel = True
        for param in (self.lora_A, self.lora_B):
            param.allreduce = not is_expert

    def _whole(self, param: Tensor) -> Tensor:
        """The unsplit tensor as used in the forward: for expert layers under ETP > 1 its gradient is summed over
        the ETP ranks (each holds a share of the products it takes part in)."""
        if self.local_only and self.tp_size > 1:
            return tensor_parallel.copy_to_tensor_model_parallel_region(param, group=self.tp_group)
        return param

    def forward(self, x: Tensor) -> Tensor:
        """`scale * B A x` laid out as the base layer's output (this rank's columns or sequence slice)."""
        x = self.dropout(x)
        if self.column_parallel:
            u = torch.nn.functional.linear(x, self._whole(self.lora_A))
            if self.sequence_parallel:
                u = tensor_parallel.gather_from_sequence_parallel_region(u, True, group=self.tp_group)
            elif not self.local_only:
                u = tensor_parallel.copy_to_tensor_model_parallel_region(u, group=self.tp_group)
            return torch.nn.functional.linear(u, self.lora_B) * self.scale
        u = torch.nn.functional.linear(x, self.lora_A)
        if self.sequence_parallel:
            u = tensor_parallel.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
        elif not self.local_only:
            u = tensor_parallel.reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        return torch.nn.functional.linear(u, self._whole(self.lora_B)) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed-checkpoint entries: the split tensor as the base weight is split (a fused gate/up
        B in its two blocks, as `MLP` does for fc1), so a checkpoint loads at any layout."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"lora_B": 0} if self.column_parallel else {"lora_A": 1}
        state = self.state_dict(prefix="", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            state, prefix, axis, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )
        if self.column_parallel and self.rules.b.tp_chunks == 2:
            key = f"{prefix}lora_B"
            singleton = bool(metadata.get("singleton_local_shards", False))
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out


def _add_delta(adapter: LoraAdapter, module, args, kwargs, output):
    """Forward hook of a base linear: its (output, bias) with the adapter's delta added to the output."""
    if not adapter.active:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


def _targeted_linears(model, table: dict[str, AdapterRules], arch: ModelArch, ctx: ParallelContext):
    """(local module name, module, its adapter rules) for every base linear of this rank that gets an adapter."""
    layer_offset, expert_offset = local_offsets(model, ctx, arch)
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        rules = table.get(canonical_name(f"{name}.weight", layer_offset, expert_offset))
        if rules is not None:
            yield name, module, rules


def _check_layout(cfg: LoraConfig, ctx: ParallelContext) -> None:
    layout = ctx.layout
    if any(t.startswith("expert_") for t in cfg.targets) and layout.etp > 1 and layout.tp % layout.etp:
        raise LoraError(
            f"LoRA on experts at trainer.parallel.etp={layout.etp}, tp={layout.tp}: the gradient norm counts the"
            f" adapter tensors every ETP rank holds whole once only when etp divides tp; change the layout or drop"
            f" the expert targets"
        )


def add_lora(model, cfg: LoraConfig, family: ModelFamily, arch: ModelArch, ctx: ParallelContext, seed: int = 0):
    """Freeze `model` (this rank's GPTModel, before DDP wraps it) and put adapters on the targeted linears; returns
    {local adapter module name: adapter}. Call before `optimizer.build_training`."""
    if not cfg.enabled:
        raise LoraError("lora.rank is 0: LoRA is off")
    if uses_te_spec(model):
        raise LoraError(
            "LoRA adapters sit on Megatron's local layer spec (ColumnParallelLinear / RowParallelLinear); this model"
            " was built with Transformer Engine layers: build it with BuildOptions(use_te=False)"
        )
    _check_layout(cfg, ctx)
    table = adapter_rule_table(family, arch, cfg.targets)
    model.requires_grad_(False)
    adapters = {}
    for name, module, rules in list(_targeted_linears(model, table, arch, ctx)):
        adapter = LoraAdapter(module, rules, cfg.rank, cfg.scale, cfg.dropout)
        parent_name, _, leaf = name.rpartition(".")
        model.get_submodule(parent_name).add_module(leaf + ADAPTER_SUFFIX, adapter)
        module.register_forward_hook(functools.partial(_add_delta, adapter), with_kwargs=True)
        adapters[name + ADAPTER_SUFFIX] = adapter
    if not adapters:
        raise LoraError(
            f"lora.targets={list(cfg.targets)} put no adapter on rank {ctx.rank} (pipeline stage {ctx.pp_rank}) of"
            f" this {family.name} model: every stage needs at least one adapted layer (add attention targets)"
        )
    init_adapter_weights(model, ctx, arch, seed)
    return adapters


def lora_adapters(model) -> dict[str, LoraAdapter]:
    """{local adapter module name: adapter} of a (possibly DDP-wrapped) model."""
    return {name.removeprefix("module."): m for name, m in model.named_modules() if isinstance(m, LoraAdapter)}


def _generator(seed: int, name: str, which: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}/{which}".encode())) % 2**63)


def _local_piece(full: Tensor, rule: ParamRule, ctx: ParallelContext) -> Tensor:
    size, rank = tp_coords(rule, ctx)
    return sharding.shard(full, rule, size, rank)


@torch.no_grad()
def init_adapter_weights(model, ctx: ParallelContext, arch: ModelArch, seed: int, b_std: float = 0.0) -> None:
    """A kaiming-uniform (bound 1/sqrt(in), as peft) and B zero, or with `b_std` > 0 normal(0, b_std) (tests: an
    adapter that changes the output); each full tensor drawn from (seed, canonical name), so any layout gets the
    same adapters."""
    for adapter in lora_adapters(model).values():
        (a_shape, b_shape), rules = adapter.full_shapes, adapter.rules
        a = torch.empty(a_shape).uniform_(-1.0, 1.0, generator=_generator(seed, rules.a.mcore, "A"))
        adapter.lora_A.copy_(_local_piece(a / math.sqrt(a_shape[1]), rules.a, ctx))
        b = torch.zeros(b_shape)
        if b_std > 0:
            b.normal_(0.0, b_std, generator=_generator(seed, rules.b.mcore, "B"))
        adapter.lora_B.copy_(_local_piece(b, rules.b, ctx))


@contextlib.contextmanager
def adapters_disabled(model):
    """Within the block the model computes the base alone (the KL reference policy: no second model)."""
    adapters = list(lora_adapters(model).values())
    before = [a.active for a in adapters]
    for adapter in adapters:
        adapter.active = False
    try:
        yield
    finally:
        for adapter, was in zip(adapters, before, strict=True):
            adapter.active = was


class AdaptersOff(torch.nn.Module):
    """The base model seen through an adapted one: every forward runs with the adapters disabled. Megatron's
    schedules find the inner model's config and `set_input_tensor` through `.module`."""

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        """The wrapped model's forward with its adapters off."""
        with adapters_disabled(self.module):
            return self.module(*args, **kwargs)


def adapted_weights(model) -> dict[str, LoraAdapter]:
    """{local name of a base weight (`decoder.layers.0.self_attention.linear_qkv.weight`): its adapter}."""
    return {name.removesuffix(ADAPTER_SUFFIX) + ".weight": a for name, a in lora_adapters(model).items()}


@torch.no_grad()
def merged_weight(adapter: LoraAdapter, weight: Tensor) -> Tensor:
    """This rank's shard of `W0 + scale * B A` in the base weight's layout and dtype (a new tensor; `weight` is
    the base linear's local weight): no communication, since B's and A's shards line up with W0's."""
    delta = adapter.lora_B.float() @ adapter.lora_A.float()
    return (weight.float() + adapter.scale * delta).to(weight.dtype)


def _is_owner(rule: ParamRule, ctx: ParallelContext) -> bool:
    """Whether this rank yields the full tensor (as `weights/gather.py` picks the owners)."""
    if rule.is_expert:
        return ctx.etp_rank == 0 and rank_coords(ctx.layout, ctx.rank).edp == 0
    return ctx.tp_rank == 0 and ctx.dp_rank == 0


def _gather(tensor: Tensor, rule: ParamRule, ctx: ParallelContext) -> Tensor:
    size, _ = tp_coords(rule, ctx)
    if rule.tp_dim is None or size == 1:
        return tensor.detach()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=ctx.etp_group if rule.is_expert else ctx.tp_group)
    return sharding.unshard(shards, rule)


def iter_adapter_tensors(model, arch: ModelArch, ctx: ParallelContext) -> Iterator[tuple[str, Tensor]]:
    """(HF / peft name, full tensor) of every adapter tensor this rank owns, e.g.
    `model.layers.0.self_attn.q_proj.lora_A.weight`: fused q/k/v and gate/up split into their HF modules (each with
    the shared A), experts by their global index. Every rank of the trainer must iterate (TP / ETP all-gathers);
    each tensor comes out of exactly one rank (TP rank 0 of DP rank 0; for experts ETP rank 0 of expert-DP rank 0
    of the EP rank that holds it), in the modules' order, A before B. The scale alpha / rank is not applied. A tensor no
    rank splits is the parameter itself (a view): copy it to keep it past the next update."""
    for adapter in lora_adapters(model).values():
        for param, rule in ((adapter.lora_A, adapter.rules.a), (adapter.lora_B, adapter.rules.b)):
            full = _gather(param, rule, ctx)
            if _is_owner(rule, ctx):
                yield from zip(rule.hf, rule.to_hf(full, arch), strict=True)


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """This rank's adapter parameters (local names): what the optimizer and DDP hold under LoRA."""
    return [(n.removeprefix("module."), p) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in LORA_PARAMS]


def owned_adapter_shapes(
    model, arch: ModelArch, ctx: ParallelContext
) -> list[tuple[str, tuple[int, ...], str, ParamRule]]:
    """(HF / peft name, shape, dtype name, rule) of every adapter tensor this rank owns, in the order
    `iter_adapter_tensors` yields them, from shapes alone (nothing is gathered; no communication)."""
    out = []
    for adapter in lora_adapters(model).values():
        shapes = adapter.full_shapes
        for param, rule, shape in zip((adapter.lora_A, adapter.lora_B), (adapter.rules.a, adapter.rules.b), shapes):
            if not _is_owner(rule, ctx):
                continue
            meta = torch.empty(shape, dtype=param.dtype, device="meta")
            for name, hf in zip(rule.hf, rule.to_hf(meta, arch), strict=True):
                out.append((name, tuple(hf.shape), str(hf.dtype).removeprefix("torch."), rule))
    return out
