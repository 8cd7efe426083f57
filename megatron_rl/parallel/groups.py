"""Process groups for one trainer process under torchrun: gloo on CPU, NCCL on GPU, Megatron's model parallel.

Megatron keeps its groups in module-level state; this module is the one place that reads it, and hands the rest
of the code an explicit `ParallelContext`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megatron_rl.parallel.devices import backend_for_device, compute_device
from megatron_rl.parallel.layout import ParallelLayout, check_layout, rank_coords
from megatron_rl.parallel.patches import apply_patches


@dataclasses.dataclass
class ParallelContext:
    """This rank's place in every parallel dimension, and the groups to talk along each."""

    layout: ParallelLayout
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    ep_group: object
    etp_group: object
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the embedding (first pipeline stage)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the output layer (last pipeline stage)."""
        return self.pp_rank == self.layout.pp - 1


def join_process_group(timeout_s: float = 600.0) -> None:
    """Join the torchrun job's default process group (env:// rendezvous) unless this process already has.

    Separate from `init_distributed` so a tool can do the rendezvous (which waits for the slowest rank's start)
    before it starts timing its own work.
    """
    if dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend_for_device(), timeout=datetime.timedelta(seconds=timeout_s))


def init_distributed(
    layout: ParallelLayout, timeout_s: float = 600.0, seed: int = 1234, gloo_groups: bool = True
) -> ParallelContext:
    """Join the torchrun job (env:// rendezvous), set up Megatron's model parallel groups, seed the RNGs.

    Every collective inherits `timeout_s`, so a dead peer ends the job with an error instead of a hang.
    `gloo_groups=False` skips Megatron's extra gloo copies of the data-parallel groups, which only the
    DistributedOptimizer's checkpoint paths use (for processes that build no optimizer, e.g. conversion).
    """
    apply_patches()

    join_process_group(timeout_s)
    check_layout(layout, dist.get_world_size())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=timeout_s / 60,  # a timedelta inside: minutes need not be whole
        create_gloo_process_groups=gloo_groups,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    device = compute_device()
    ctx = ParallelContext(
        layout=layout,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        device=device,
    )
    _check_coords_match(ctx)
    return ctx


def _check_coords_match(ctx: ParallelContext) -> None:
    """The pure `rank_coords` must agree with Megatron's groups: the weight plan relies on it."""
    want = rank_coords(ctx.layout, ctx.rank)
    got = (ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.ep_rank, ctx.etp_rank)
    if got != (want.tp, want.pp, want.dp, want.ep, want.etp):
        raise RuntimeError(f"rank {ctx.rank}: Megatron placed it at {got}, rank_coords says {want}")


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
