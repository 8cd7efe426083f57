"""torch.distributed's patches (parallel/patches/torch_distributed.py), each against the failure it fixes.

The store checks run in subprocesses, so that the patched `TCPStore` does not leak into other tests.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from megatron_rl.parallel.patches import UnsafeCheckpointError, apply_torch_patches, read_metadata_safely

STORE_PROBE = r"""
import json, sys, psutil, torch.distributed as dist
if sys.argv[1] == "patched":
    from megatron_rl.parallel.patches import apply_torch_patches
    apply_torch_patches()
store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", store.port, None, False)
client.set("k", "v")
mine = [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
print(json.dumps({"listen": mine, "value": store.get("k").decode()}))
"""


def _probe(mode: str) -> dict:
    result = subprocess.run([sys.executable, "-c", STORE_PROBE, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tcp_store_server_listens_on_its_host_only():
    assert _probe("plain")["listen"] == ["::"]  # the failure: every interface, whatever host_name says
    patched = _probe("patched")
    assert patched == {"listen": ["127.0.0.1"], "value": "v"}


def test_a_taken_port_stays_torchs_error_so_c10d_falls_back_to_a_client():
    """Two agents of one job both try to host the rendezvous store; the one that loses must see torch's
    DistNetworkError (c10d_rendezvous_backend catches it and connects as a client)."""
    code = r"""
import socket, torch.distributed as dist
from megatron_rl.parallel.patches import apply_torch_patches
apply_torch_patches()
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen(1)
try:
    dist.TCPStore("127.0.0.1", taken.getsockname()[1], None, True, wait_for_workers=False)
except dist.DistNetworkError as err:
    print("DistNetworkError", "cannot host a TCPStore on 127.0.0.1" in str(err))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["DistNetworkError", "True"], result.stderr[-3000:]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_metadata_unpickler_refuses_what_torch_dist_metadata_never_holds():
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

    genuine = Metadata(state_dict_metadata={}, planner_data={"x": TensorProperties(dtype=torch.bfloat16)})
    assert isinstance(read_metadata_safely(io.BytesIO(pickle.dumps(genuine))), Metadata)
    with pytest.raises(UnsafeCheckpointError, match="refers to posix.system"):
        read_metadata_safely(io.BytesIO(pickle.dumps(_RunsCode())))
    with pytest.raises(UnsafeCheckpointError, match="holds a dict, not a torch_dist Metadata"):
        read_metadata_safely(io.BytesIO(pickle.dumps({})))


def test_byte_records_load_as_plain_data_only():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    apply_torch_patches()
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(
        type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("obj"), dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("obj"), storage_offsets=torch.Size([0]), lengths=torch.Size([0]),
    )  # fmt: skip
    plain = io.BytesIO()
    torch.save([None, {"step": 3}], plain)
    plain.seek(0)
    planner.load_bytes(item, plain)
    assert planner.state_dict["obj"] == [None, {"step": 3}]
    crafted = io.BytesIO()
    torch.save(_RunsCode(), crafted)
    crafted.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        planner.load_bytes(item, crafted)


GLOO_PROBE = r"""
import json, os, sys, datetime, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
if sys.argv[1] == "patched":
    from megatron_rl.parallel.patches import apply_torch_patches
    from megatron_rl.parallel.patches.torch_distributed import share_gloo_devices
    apply_torch_patches()
    share_gloo_devices()  # as a vLLM engine's patches would: applied once, not wrapped twice
    assert not hasattr(c10d._new_process_group_helper.original, "original")
store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
groups = [dist.new_group([0]) for _ in range(5)]
sums = []
for i, group in enumerate([None, *groups]):
    t = torch.tensor([float(i)])
    dist.all_reduce(t, group=group)
    sums.append(t.item())
own = dist.ProcessGroupGloo._Options()
own._devices = [dist.ProcessGroupGloo.create_default_device()]
weight_like = dist.ProcessGroupGloo(dist.PrefixStore("own", store), 0, 1, own)  # as the weight groups make theirs
loops = sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop" for t in os.listdir("/proc/self/task"))
print(json.dumps({"sums": sums, "loop_threads": loops, "torch_class": c10d.ProcessGroupGloo is dist.ProcessGroupGloo,
                  "own_is_gloo": isinstance(weight_like, c10d.ProcessGroupGloo)}))
dist.destroy_process_group()
"""


def _gloo_probe(mode: str) -> dict:
    result = subprocess.run([sys.executable, "-c", GLOO_PROBE, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_gloo_groups_torch_makes_share_one_device_and_explicit_ones_keep_theirs():
    patched, plain = _gloo_probe("patched"), _gloo_probe("plain")
    assert patched["sums"] == plain["sums"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert plain["loop_threads"] == 7  # a device (and its loop thread) per group: 6, and the explicit one
    assert patched["loop_threads"] == 2  # the six groups' shared device, and the explicit group's own
    assert patched["torch_class"] and patched["own_is_gloo"]  # torch's class is its own again after each group
