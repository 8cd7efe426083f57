"""Rank layout arithmetic as pure functions: world size, validation against a model, rank coordinates.

Megatron's convention: world = tp * cp * dp * pp for dense parts; within one pipeline stage the same ranks are
re-divided as ep * etp * edp for expert layers, so expert parallelism folds over data (and tensor) parallelism.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.errors import UserError
from megatron_rl.models.base import ModelArch


class LayoutError(UserError, ValueError):
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
    first_stage_layers: int | None = None
    """Transformer layers on the first pipeline stage (Megatron's `num_layers_in_first_pipeline_stage`); None
    splits evenly. The stages without an explicit count share the remaining layers evenly."""
    last_stage_layers: int | None = None
    """Transformer layers on the last pipeline stage (Megatron's `num_layers_in_last_pipeline_stage`); None
    splits evenly."""

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

    @property
    def uneven(self) -> bool:
        """Whether the first or last pipeline stage has an explicit layer count."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def describe(self) -> str:
        """A short name such as `tp2-pp1-ep2-etp1-dp1` (`-first1-last2` appended for uneven stages)."""
        name = f"tp{self.tp}-pp{self.pp}-ep{self.ep}-etp{self.etp}-dp{self.data_parallel}"
        if self.first_stage_layers is not None:
            name += f"-first{self.first_stage_layers}"
        if self.last_stage_layers is not None:
            name += f"-last{self.last_stage_layers}"
        return name

    def megatron_kwargs(self) -> dict:
        """The uneven-pipeline TransformerConfig arguments (empty for an even split, Megatron's default)."""
        kwargs = {}
        if self.first_stage_layers is not None:
            kwargs["num_layers_in_first_pipeline_stage"] = self.first_stage_layers
        if self.last_stage_layers is not None:
            kwargs["num_layers_in_last_pipeline_stage"] = self.last_stage_layers
        return kwargs


def layout_from_config(parallel) -> ParallelLayout:
    """The layout of a `trainer.parallel` config section, or of anything with its field names (the CLI's flags)."""
    return ParallelLayout(
        tp=parallel.tp, pp=parallel.pp, ep=parallel.ep, etp=parallel.etp, dp=parallel.dp,
        first_stage_layers=parallel.first_stage_layers, last_stage_layers=parallel.last_stage_layers,
    )  # fmt: skip


def check_layout(layout: ParallelLayout, world_size: int | None = None) -> None:
    """Raise LayoutError when sizes are not positive or do not multiply to the world size."""
    for field in ("tp", "pp", "ep", "etp"):
        value = getattr(layout, field)
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"parallel.{field}={value!r}: must be a positive integer")
    if layout.dp is not None and layout.dp < 1:
        raise LayoutError(f"parallel.dp={layout.dp!r}: must be a positive integer")
    _check_stage_fields(layout)
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
    stage_layer_counts(layout, arch.num_layers)  # pp and the uneven-stage fields


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


def _check_stage_fields(layout: ParallelLayout) -> None:
    """The uneven-stage counts must be positive and need a pipeline with room for them."""
    for field in ("first_stage_layers", "last_stage_layers"):
        value = getattr(layout, field)
        if value is None:
            continue
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"parallel.{field}={value!r}: must be a positive integer (or empty for an even split)")
        if layout.pp < 2:
            raise LayoutError(f"parallel.{field}={value}: needs pp >= 2 (got pp={layout.pp})")


def stage_layer_counts(layout: ParallelLayout, num_layers: int) -> list[int]:
    """Transformer layers of each pipeline stage by Megatron's rule: the first/last stage take their explicit
    counts, the other stages split the rest evenly. Raises LayoutError naming the fields when that does not divide.
    """
    _check_stage_fields(layout)
    fixed = {0: layout.first_stage_layers, layout.pp - 1: layout.last_stage_layers}
    fixed = {stage: count for stage, count in fixed.items() if count is not None}
    rest = num_layers - sum(fixed.values())
    others = layout.pp - len(fixed)
    if not fixed:
        if num_layers % layout.pp:
            raise LayoutError(
                f"parallel.pp={layout.pp}: the model's layers ({num_layers}) is not divisible by {layout.pp}"
                " (set parallel.first_stage_layers / last_stage_layers for an uneven split)"
            )
        return [num_layers // layout.pp] * layout.pp
    named = ", ".join(
        f"parallel.{f}={getattr(layout, f)}"
        for f in ("first_stage_layers", "last_stage_layers")
        if getattr(layout, f) is not None
    )
    if others == 0 and rest != 0:
        raise LayoutError(
            f"{named}: with pp={layout.pp} there are no other stages, so they must add up to the model's"
            f" {num_layers} layers"
        )
    if others and (rest <= 0 or rest % others):
        raise LayoutError(
            f"{named}: the remaining {rest} of the model's {num_layers} layers must split evenly (at least one"
            f" each) over the other {others} of pp={layout.pp} stages"
        )
    per = rest // others if others else 0
    return [fixed.get(stage, per) for stage in range(layout.pp)]


def layers_of_stage(num_layers: int, pp: int, stage: int, first: int | None = None, last: int | None = None) -> range:
    """Global layer indices held by pipeline stage `stage` (even split unless `first`/`last` stage counts given)."""
    counts = stage_layer_counts(ParallelLayout(pp=pp, first_stage_layers=first, last_stage_layers=last), num_layers)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def stage_of_layer(layout: ParallelLayout, num_layers: int, layer: int) -> int:
    """The pipeline stage that holds global layer `layer`."""
    counts = stage_layer_counts(layout, num_layers)
    end = 0
    for stage, count in enumerate(counts):
        end += count
        if layer < end:
            return stage
    raise LayoutError(f"layer {layer} is beyond the model's {num_layers} layers")


def experts_of_rank(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global expert indices held by expert-parallel rank `ep_rank`."""
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)
