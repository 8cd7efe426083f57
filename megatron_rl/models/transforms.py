"""The few tensor transforms between Hugging Face and Megatron layouts, each a pair (to_mcore, to_hf).

Megatron's fused QKV weight is grouped by query group: for each of the `num_kv_heads` groups, that group's query
heads, then its key head, then its value head, along dimension 0. Splitting it contiguously across tensor
parallel ranks therefore hands each rank whole groups. Megatron's fused gate/up weight is [gate; up].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from megatron_rl.models.base import ModelArch


def _copy_to_mcore(hf: list, arch: ModelArch):
    return hf[0]


def _copy_to_hf(tensor, arch: ModelArch) -> list:
    return [tensor]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Interleave separate q, k, v projections (weights or biases) into Megatron's grouped QKV layout."""
    import torch  # here, not at the top: the CLI reads the families (models/) without torch

    heads_per_group = num_heads // num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(num_kv_heads, heads_per_group * head_dim, *tail)
    k = k.reshape(num_kv_heads, head_dim, *tail)
    v = v.reshape(num_kv_heads, head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(num_kv_heads * (heads_per_group + 2) * head_dim, *tail).contiguous()


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> list:
    """Inverse of `fuse_qkv`: Megatron's grouped QKV back to separate q, k, v tensors."""
    heads_per_group = num_heads // num_kv_heads
    tail = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (heads_per_group + 2) * head_dim, *tail)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return [
        q.reshape(num_heads * head_dim, *tail).contiguous(),
        k.reshape(num_kv_heads * head_dim, *tail).contiguous(),
        v.reshape(num_kv_heads * head_dim, *tail).contiguous(),
    ]


def _qkv_to_mcore(hf: list, arch: ModelArch):
    return fuse_qkv(hf[0], hf[1], hf[2], arch.num_heads, arch.num_kv_heads, arch.head_dim)


def _qkv_to_hf(tensor, arch: ModelArch) -> list:
    return split_qkv(tensor, arch.num_heads, arch.num_kv_heads, arch.head_dim)


def _gate_up_to_mcore(hf: list, arch: ModelArch):
    import torch  # here, not at the top: the CLI reads the families (models/) without torch

    return torch.cat([hf[0], hf[1]], dim=0)


def _gate_up_to_hf(tensor, arch: ModelArch) -> list:
    gate, up = tensor.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    "copy": (_copy_to_mcore, _copy_to_hf),
    "qkv": (_qkv_to_mcore, _qkv_to_hf),
    "gate_up": (_gate_up_to_mcore, _gate_up_to_hf),
}
"""Transform name -> (HF tensors to full Megatron tensor, full Megatron tensor to HF tensors)."""
