"""Starting or joining a Ray cluster with safe defaults: loopback only, no dashboard, a private temp dir."""

from __future__ import annotations

import os
import tempfile

NAMESPACE = "megatron-rl"


def start_local_ray(num_cpus: int | None = None, temp_dir: str | None = None) -> dict:
    """Start a local Ray head bound to loopback; returns {'address', 'temp_dir'} for processes that join it."""
    import ray

    if ray.is_initialized():
        return {"address": ray.get_runtime_context().gcs_address, "temp_dir": temp_dir or ""}
    # Ray's socket paths must stay short: a short folder under /tmp.
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="mrl-ray-", dir="/tmp")
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        namespace=NAMESPACE,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )
    return {"address": ray.get_runtime_context().gcs_address, "temp_dir": temp_dir}


def join_ray(address: str) -> None:
    """Join an existing Ray cluster (from a torchrun trainer process) in this project's namespace."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, configure_logging=False, log_to_driver=False)
