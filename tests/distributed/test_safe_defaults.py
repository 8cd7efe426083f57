"""Safe defaults, checked on real processes: a local Ray and the weight-sync stores listen on loopback only."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import textwrap

import psutil

from megatron_rl.weights.transport import WeightGroup

PROBE = textwrap.dedent(
    """
    import json, os, psutil
    from megatron_rl.rollout.ray_env import prefer_loopback_ray
    prefer_loopback_ray()  # what every entry point does before anything imports ray
    from megatron_rl.rollout.ray_utils import start_local_ray
    start_local_ray(num_cpus=1)
    import ray
    @ray.remote
    def ping():
        return os.getpid()
    ray.get(ping.remote(), timeout=120)  # a worker process is up too
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    listening = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [[proc.name(), c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN]
    print(json.dumps(listening))
    ray.shutdown()
    """
)


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_local_ray_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}  # as a user's shell
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    listening = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert any(name == "gcs_server" for name, _, _ in listening), listening
    exposed = [entry for entry in listening if not _is_loopback(entry[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_local_ray_refuses_to_start_in_cluster_mode():
    """Ray imported before the loopback switch (an entry point that forgot it) would listen on every interface."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    code = "from megatron_rl.rollout.ray_utils import start_local_ray; start_local_ray(num_cpus=1)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "would listen on every interface" in out.stderr and "prefer_loopback_ray" in out.stderr


def test_weight_store_listens_on_the_configured_host_only():
    store, port = WeightGroup.host_store("127.0.0.1", timeout_s=10)
    conns = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    mine = [c for c in conns if c.laddr.port == port]
    assert mine and all(_is_loopback(c.laddr.ip) for c in mine), mine
    store.set("k", "v")
    assert store.get("k") == b"v"
