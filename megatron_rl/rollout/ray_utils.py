"""Starting or joining a Ray cluster with safe defaults: loopback only, no dashboard, a private temp dir."""

from __future__ import annotations

import logging
import os
import tempfile

import ray
from ray._private import ray_constants
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from megatron_rl.parallel.torchrun import loopback_gloo_env
from megatron_rl.rollout.ray_env import LOCAL_ONLY_ENV

NAMESPACE = "megatron-rl"


def start_local_ray(num_cpus: int | None = None, temp_dir: str | None = None, log_to_driver: bool = True) -> dict:
    """Start a local Ray head bound to loopback; returns {'address', 'temp_dir'} for processes that join it.

    `log_to_driver=False` keeps the actors' output (vLLM's) in Ray's worker logs instead of this console.
    Raises RuntimeError when Ray was imported in cluster mode (`ray_env.prefer_loopback_ray` came too late or
    not at all): its servers would listen on every interface. The actors it runs (the engines and their vLLM
    workers) get gloo bound to loopback (GLOO_SOCKET_IFNAME, unless set): a local Ray's actors all run here,
    and gloo otherwise binds the address the host name resolves to.
    """
    if ray.is_initialized():
        return {"address": ray.get_runtime_context().gcs_address, "temp_dir": temp_dir or ""}
    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(
            f"a local Ray would listen on every interface: set {LOCAL_ONLY_ENV}=0 (megatron_rl.rollout.ray_env."
            "prefer_loopback_ray()) before ray is first imported"
        )
    _ray_logs_follow_this_process()
    loopback_gloo_env(os.environ)  # Ray's worker processes inherit this process's environment
    # Ray's socket paths must stay short: a short folder under /tmp.
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="mrl-ray-", dir="/tmp")
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        namespace=NAMESPACE,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        log_to_driver=log_to_driver,
        configure_logging=False,
    )
    return {"address": ray.get_runtime_context().gcs_address, "temp_dir": temp_dir}


def on_this_node() -> dict:
    """Ray actor options that place an actor on the caller's node: the run's small bookkeeping actors (0 CPUs)
    would otherwise land on any node of a multi-node cluster, e.g. a trainer node."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


def join_ray(address: str) -> None:
    """Join an existing Ray cluster (from a torchrun trainer process) in this project's namespace."""
    if not ray.is_initialized():
        _ray_logs_follow_this_process()
        ray.init(address=address, namespace=NAMESPACE, configure_logging=False, log_to_driver=False)


def _ray_logs_follow_this_process() -> None:
    """Let Ray's driver-side log records reach this process's logging handlers (a run's launcher.log).

    `ray.init(configure_logging=False)` clears the "ray" logger's handlers but leaves it not propagating (as Ray
    2.60 sets it at import), so its warnings went to Python's last-resort handler: the console.
    """
    logging.getLogger("ray").propagate = True
