"""Starting or joining a Ray cluster with safe defaults: loopback only, no dashboard, a private temp dir."""

from __future__ import annotations

import os
import tempfile

NAMESPACE = "megatron-rl"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch (read once, when `ray` is imported) between a single-machine setup, whose GCS, raylet and
workers listen on loopback, and cluster mode, which binds them to every interface even for `ray.init()` on one
machine (measured: Ray 2.60 started by `ray.init(_node_ip_address='127.0.0.1')` listens on `*`)."""


def prefer_loopback_ray() -> None:
    """Make a local Ray started later in this process (and its workers) listen on loopback only; call it before
    `ray` is first imported. Not for processes that join a multi-node cluster: their address must be routable."""
    os.environ.setdefault(LOCAL_ONLY_ENV, "0")


def start_local_ray(num_cpus: int | None = None, temp_dir: str | None = None) -> dict:
    """Start a local Ray head bound to loopback; returns {'address', 'temp_dir'} for processes that join it."""
    prefer_loopback_ray()
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


def on_this_node() -> dict:
    """Ray actor options that place an actor on the caller's node: the run's small bookkeeping actors (0 CPUs)
    would otherwise land on any node of a multi-node cluster, e.g. a trainer node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


def join_ray(address: str) -> None:
    """Join an existing Ray cluster (from a torchrun trainer process) in this project's namespace."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, configure_logging=False, log_to_driver=False)
