"""Rank layout arithmetic as pure functions: world size, validation against a model, rank coordinates.

Megatron's convention: world = tp * cp * dp * pp for dense parts; within one pipeline stage the same ranks are
re-divided as ep * etp * edp for expert layers, so expert parallelism folds over data (and tensor) parallelism.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.models.base import ModelArch


class LayoutError(ValueError):
    """A parallel layout that does not divide the world or the model."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension of the trainer."""

    tp: int = 1
    """Tensor parallel size (dense layers and attention)."""
    pp: int = 1
    """Pipeline parallel size."""
    ep: int = 1
    """Expert parallel size."""
    etp: int = 1
    """Expert tensor parallel size (tensor parallelism inside each expert)."""
    dp: int | None = None
    """Data parallel size; None picks the smallest that fits EP x ETP."""

    @property
    def data_parallel(self) -> int:
        """The data parallel size: the given one, or the smallest with tp * dp divisible by ep * etp."""
        if self.dp is not None:
            return self.dp
        return math.lcm(self.tp, self.ep * self.etp) // self.tp

    @property
    def world_size(self) -> int:
        """Number of trainer processes."""
        return self.tp * self.pp * self.data_parallel

    @property
    def expert_data_parallel(self) -> int:
        """Data parallel size of expert layers."""
        return self.tp * self.data_parallel // (self.ep * self.etp)

    def describe(self) -> str:
        """A short name such as `tp2-pp1-ep2-etp1-dp1`."""
        return f"tp{self.tp}-pp{self.pp}-ep{self.ep}-etp{self.etp}-dp{self.data_parallel}"


def check_layout(layout: ParallelLayout, world_size: int | None = None) -> None:
    """Raise LayoutError when sizes are not positive or do not multiply to the world size."""
    for field in ("tp", "pp", "ep", "etp"):
        value = getattr(layout, field)
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"parallel.{field}={value!r}: must be a positive integer")
    if layout.dp is not None and layout.dp < 1:
        raise LayoutError(f"parallel.dp={layout.dp!r}: must be a positive integer")
    if (layout.tp * layout.data_parallel) % (layout.ep * layout.etp):
        raise LayoutError(
            f"parallel: tp*dp={layout.tp * layout.data_parallel} is not divisible by ep*etp={layout.ep * layout.etp}"
            " (expert parallelism folds over tensor x data parallel ranks)"
        )
    if world_size is not None and world_size != layout.world_size:
        raise LayoutError(
            f"parallel: world size {world_size} is not tp*pp*dp = {layout.tp}*{layout.pp}*{layout.data_parallel}"
            f" = {layout.world_size} ({layout.describe()})"
        )


def check_layout_fits_model(layout: ParallelLayout, arch: ModelArch) -> None:
    """Raise LayoutError, naming the model dimension, when the layout does not divide the model."""
    check_layout(layout)
    needs = [
        ("attention heads", arch.num_heads, layout.tp, "tp"),
        ("key/value heads", arch.num_kv_heads, layout.tp, "tp"),
        ("vocabulary size", arch.vocab_size, layout.tp, "tp"),
        ("layers", arch.num_layers, layout.pp, "pp"),
    ]
    if any(not arch.is_moe_layer(i) for i in range(arch.num_layers)):
        needs.append(("dense MLP width", arch.ffn_hidden_size, layout.tp, "tp"))
    if arch.num_experts:
        needs += [
            ("experts", arch.num_experts, layout.ep, "ep"),
            ("expert MLP width", arch.moe_ffn_hidden_size, layout.etp, "etp"),
        ]
    elif layout.ep > 1:
        raise LayoutError(f"parallel.ep={layout.ep}: the {arch.family} model has no experts")
    for what, size, parts, field in needs:
        if size % parts:
            raise LayoutError(f"parallel.{field}={parts}: the model's {what} ({size}) is not divisible by {parts}")


@dataclasses.dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in each parallel dimension."""

    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    edp: int


def rank_coords(layout: ParallelLayout, rank: int) -> RankCoords:
    """Coordinates of `rank` in Megatron's default order (tp fastest, then dp, then pp; experts etp-ep-edp)."""
    tp, dp = layout.tp, layout.data_parallel
    per_stage = tp * dp
    pp_rank, in_stage = divmod(rank, per_stage)
    dp_rank, tp_rank = divmod(in_stage, tp)
    edp_rank, rest = divmod(in_stage, layout.ep * layout.etp)
    ep_rank, etp_rank = divmod(rest, layout.etp)
    return RankCoords(tp=tp_rank, pp=pp_rank, dp=dp_rank, ep=ep_rank, etp=etp_rank, edp=edp_rank)


def layers_of_stage(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices held by pipeline stage `stage` (even split)."""
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def experts_of_rank(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global expert indices held by expert-parallel rank `ep_rank`."""
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)
