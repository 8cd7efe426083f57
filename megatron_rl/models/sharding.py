"""Pure sharding arithmetic: cut a full Megatron tensor into tensor-parallel shards and put shards back together.

A rule with `tp_chunks` > 1 (fused gate/up) is that many blocks along `tp_dim`; each block is cut separately,
so rank r holds [gate_r; up_r], as Megatron's column-parallel fused fc1 does.
"""

from __future__ import annotations

import torch

from megatron_rl.models.base import ParamRule


def shard(full: torch.Tensor, rule: ParamRule, size: int, rank: int) -> torch.Tensor:
    """The piece of `full` that tensor-parallel rank `rank` of `size` holds."""
    if rule.tp_dim is None or size == 1:
        return full
    dim = rule.tp_dim
    if full.shape[dim] % (size * rule.tp_chunks):
        raise ValueError(
            f"{rule.mcore}: dim {dim} of shape {tuple(full.shape)} does not split into {size} x {rule.tp_chunks}"
        )
    blocks = full.chunk(rule.tp_chunks, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], rule: ParamRule) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's piece, in rank order."""
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    dim = rule.tp_dim
    per_rank_blocks = [s.chunk(rule.tp_chunks, dim=dim) for s in shards]
    blocks = [torch.cat([p[c] for p in per_rank_blocks], dim=dim) for c in range(rule.tp_chunks)]
    return torch.cat(blocks, dim=dim)


def shard_shape(full_shape: tuple[int, ...], rule: ParamRule, size: int) -> tuple[int, ...]:
    """Shape of one rank's shard of a tensor of `full_shape`."""
    if rule.tp_dim is None:
        return tuple(full_shape)
    shape = list(full_shape)
    shape[rule.tp_dim] //= size
    return tuple(shape)
