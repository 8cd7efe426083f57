"""What a run exposes: every TCP socket listening in any process of a real `megatron-rl train` (launcher, its
local Ray, the engine and its vLLM processes, the torchrun agent and the trainer ranks) is on loopback, on a
host whose name resolves to a non-loopback address.

The run goes into private network, mount and UTS namespaces (root, `unshare`), where the host name `testhost`
resolves to 198.18.0.1, an address on a veth interface that exists only there: this is what would show gloo
binding the host name's address (which on this machine is 127.0.0.1 and would hide it). Listening sockets are
read from /proc: the socket inodes behind /proc/PID/fd, matched in /proc/PID/net/tcp{,6} (that PID's own
network namespace), state 0A (LISTEN).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

NETNS = """
set -e
ip link set lo up
ip link add mrl0 type veth peer name mrl1
ip addr add 198.18.0.1/24 dev mrl0
ip link set mrl0 up
ip link set mrl1 up
hostname testhost
printf '127.0.0.1 localhost\\n198.18.0.1 testhost\\n' > "$HOSTS_FILE"
mount --bind "$HOSTS_FILE" /etc/hosts
exec "$@"
"""
"""Run the command where `testhost` (the host name) resolves to 198.18.0.1; the namespaces die with it."""


def _address(hex_address: str) -> tuple[str, int]:
    ip, port = hex_address.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:  # one little-endian 32-bit word
        text = socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    else:  # four little-endian 32-bit words
        text = socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *struct.unpack(">4I", raw)))
    return text, int(port, 16)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _tree(root: int) -> set[int]:
    """`root` and every process below it (from the parent ids in /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return seen


def listeners(pids: set[int]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    found = set()
    for pid in pids:
        inodes = _socket_inodes(pid)
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:
                    found.add((name, *_address(fields[1])))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address."""
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")), reason="needs root, unshare and ip"
)
def test_a_run_listens_on_loopback_only_where_the_host_name_is_not_loopback(tmp_path):
    train = [
        sys.executable, "-m", "megatron_rl.cli", "train", str(REPO / "configs/quickstart.yaml"), "steps=4",
        f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "name=exposed", "--json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["HOSTS_FILE"] = str(tmp_path / "hosts")
    cmd = ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "sh", "-c", NETNS, "netns", *train]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, str, int]] = set()
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= listeners(_tree(proc.pid))
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "listeners.json").write_text(json.dumps(sorted(seen)))  # kept: what the run listened on
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 4
    assert "hosts" in os.listdir(tmp_path) and Path("/etc/hosts").read_text() != (tmp_path / "hosts").read_text()
    # The run's processes were all seen listening: Ray's servers, the torchrun agent, the ranks' gloo pairs.
    owners = {name for name, _, _ in seen}
    assert {"gcs_server", "raylet", "pt_elastic"} <= owners, owners
    assert any(name.startswith("python") for name in owners), owners  # the trainer ranks (gloo, weight store)
    exposed = sorted(entry for entry in seen if not is_loopback(entry[1]))
    assert not exposed, f"listening beyond loopback: {exposed}"
