"""Which device and collective backend this process computes with. torch only: the engine-side weight path
(inside vLLM workers) uses it too, and must not import Megatron."""

from __future__ import annotations

import torch


def compute_device() -> torch.device:
    """This process's accelerator (the current CUDA device), or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def backend_for_device() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"
