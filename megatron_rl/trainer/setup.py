"""One call that brings a trainer rank up: process groups, model family, GPTModel at this layout."""

from __future__ import annotations

import dataclasses

from megatron_rl.models import ModelArch, ModelFamily, family_for_hf_config, read_hf_config
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.parallel.groups import ParallelContext, init_distributed
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.checkpoint import load_checkpoint, read_hf_config_of, read_meta
from megatron_rl.trainer.hf_weights import load_hf_into_model
from megatron_rl.trainer.model import BuildOptions, build_gpt_model


@dataclasses.dataclass
class TrainerRank:
    """Everything one trainer process holds about its model."""

    ctx: ParallelContext
    family: ModelFamily
    arch: ModelArch
    hf_config: dict
    model: object


def bring_up(
    hf_config: dict,
    layout: ParallelLayout,
    opts: BuildOptions,
    timeout_s: float = 600.0,
    seed: int = 1234,
    gloo_groups: bool = True,
) -> TrainerRank:
    """Initialise distributed state and build this rank's model for a HF config dictionary.

    `gloo_groups=False` is for processes that build no DistributedOptimizer (see `init_distributed`).
    """
    family = family_for_hf_config(hf_config)
    arch = family.arch_from_hf(hf_config)
    ctx = init_distributed(layout, timeout_s=timeout_s, seed=seed, gloo_groups=gloo_groups)
    model = build_gpt_model(family, arch, hf_config, ctx, opts)
    return TrainerRank(ctx=ctx, family=family, arch=arch, hf_config=hf_config, model=model)


def bring_up_from_hf(
    hf_dir: str, layout: ParallelLayout, opts: BuildOptions | None = None, timeout_s: float = 600.0
) -> TrainerRank:
    """Build this rank's model and load a HF checkpoint folder into it."""

    opts = opts or BuildOptions(init_weights=False)
    rank = bring_up(read_hf_config(hf_dir), layout, opts, timeout_s)
    load_hf_into_model(rank.model, HFCheckpoint(hf_dir), rank.family, rank.arch, rank.ctx)
    return rank


def bring_up_from_mcore(mcore_dir: str, layout: ParallelLayout, timeout_s: float = 600.0) -> TrainerRank:
    """Build this rank's model and load a distributed checkpoint (saved at any layout) into it."""

    meta = read_meta(mcore_dir)
    rank = bring_up(
        read_hf_config_of(mcore_dir), layout, BuildOptions(dtype=meta["dtype"], init_weights=False), timeout_s
    )
    load_checkpoint(rank.model, mcore_dir)
    return rank
