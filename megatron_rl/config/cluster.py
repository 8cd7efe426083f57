"""The cluster a production run is planned for."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_rl.config.base import Section

GPU_MEMORY_GB = {"h100": 80.0, "h200": 141.0}
"""Memory of each GPU type the planner knows (SXM parts), in GB as the vendors state it (10^9 bytes)."""


class ClusterConfig(Section):
    """The machines a production run is planned for (`megatron-rl plan`); local runs ignore it."""

    gpu: Literal["h100", "h200"] = "h100"
    """GPU type of every node."""
    gpu_memory_gb: float | None = Field(None, gt=0)
    """Memory of one GPU in GB (10^9 bytes); empty: the type's own (h100 80, h200 141)."""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs per node."""
    trainer_nodes: int | None = Field(None, ge=1)
    """Nodes of the Megatron trainer: its world size must be trainer_nodes x gpus_per_node. Empty: trainer and
    engines share one node (a local run)."""
    inference_nodes: int | None = Field(None, ge=1)
    """Nodes of the vLLM engines: num_engines x engine_tp x engine_dp must be inference_nodes x gpus_per_node.
    Empty: trainer and engines share one node (a local run)."""

    @property
    def memory_gb(self) -> float:
        """Memory of one GPU in GB: the configured value or the GPU type's."""
        return self.gpu_memory_gb if self.gpu_memory_gb is not None else GPU_MEMORY_GB[self.gpu]
