"""What the engine-against-trainer checks (`verify routing`, `verify sampling-mask`) share: the model's shape
checked against the trainer's layout, and the engine phase on a local Ray that is let go before the trainer
starts (two cores cannot hold both)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import ray

from megatron_rl.models import ModelArch, ModelFamily, family_for_hf_config, read_hf_config
from megatron_rl.parallel.layout import ParallelLayout, check_layout_fits_model
from megatron_rl.rollout.ray_utils import start_local_ray

T = TypeVar("T")


def model_at_layout(hf_dir: str, layout: ParallelLayout) -> tuple[ModelFamily, ModelArch]:
    """The checkpoint's family and shape; LayoutError when the layout cannot shard it."""
    hf_config = read_hf_config(hf_dir)
    family = family_for_hf_config(hf_config, where=f"{hf_dir}/config.json")
    arch = family.arch_from_hf(hf_config, f"{hf_dir}/config.json")
    check_layout_fits_model(layout, arch)
    return family, arch


def on_local_ray(phase: Callable[[], T]) -> tuple[T, float]:
    """(`phase()`'s result, its seconds) on a local Ray; a Ray started here is shut down after it, so that its
    memory is free before the trainer starts."""
    had_ray = ray.is_initialized()
    start_local_ray()
    start = time.perf_counter()
    try:
        return phase(), time.perf_counter() - start
    finally:
        if not had_ray:
            ray.shutdown()
