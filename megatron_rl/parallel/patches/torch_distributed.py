"""torch.distributed's patches: distributed checkpoints that run no code from their files, TCPStore servers that
listen on the address they are given, and gloo process groups that share one device per process.

Applied by `apply_torch_patches()` (idempotent, every device; `apply_patches()` calls it, and so does every
checkpoint load and the torchrun agent, `parallel/torchrun.py`). Checked on torch 2.13.0 with megatron-core 0.16.1.
Each imports what it patches when it is applied (see the package docstring).
"""

from __future__ import annotations

import io
import os
import pickle
import socket

import torch
import torch.distributed as dist  # `import torch` has loaded it already

_TORCH_APPLIED: list[str] = []


def applied_torch_patches() -> list[str]:
    """Names of the torch patches applied in this process."""
    return list(_TORCH_APPLIED)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's `.metadata` names a class that torch_dist metadata never holds (a crafted file)."""


_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup by name in torch's own layout table
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
}
"""Every class a torch_dist `.metadata` file refers to, recorded from Megatron-Core 0.16.1 checkpoints (model and
DistributedOptimizer state, 1 and 2 ranks; torch 2.13), besides the `torch.<dtype>` names."""

_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch_dist metadata: resolves only the classes in `_METADATA_CLASSES` and torch's dtypes."""

    def find_class(self, module: str, name: str):
        """The class `module.name` when torch_dist metadata may hold it; UnsafeCheckpointError otherwise."""
        if (module, name) in _METADATA_CLASSES or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refers to {module}.{name}, which torch_dist metadata never holds: refusing to load it (a crafted or "
            "foreign file; megatron_rl.parallel.patches.torch_distributed lists what is allowed)"
        )


def read_metadata_safely(stream) -> object:
    """The torch_dist `Metadata` pickled in `stream`, unpickled with `MetadataUnpickler` (and checked to be one)."""
    from torch.distributed.checkpoint.metadata import Metadata  # torch.distributed's checkpoint package loads lazily

    metadata = MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"holds a {type(metadata).__name__}, not a torch_dist Metadata")
    return metadata


def _patch_dcp_metadata_allow_list() -> None:
    """Failure: `FileSystemReader.read_metadata` unpickles a checkpoint's `.metadata` with plain `pickle.load`
    (torch/distributed/checkpoint/filesystem.py), on every rank of every torch_dist load (Megatron's
    `CachedMetadataFileSystemReader` calls it): a crafted file ran `os.system` under `megatron-rl convert
    mcore-to-hf` and the load then went on normally. Fix: the same steps with `MetadataUnpickler`, which resolves
    only the classes real metadata holds. torch 2.13.0, megatron-core 0.16.1."""
    from torch.distributed.checkpoint import filesystem  # at apply time (see the module docstring)
    from torch.distributed.checkpoint.metadata import StorageMeta  # at apply time

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = read_metadata_safely(stream)
            except UnsafeCheckpointError as err:
                raise UnsafeCheckpointError(f"{path}: {err}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    filesystem.FileSystemReader.read_metadata = read_metadata


def _patch_dcp_bytes_weights_only() -> None:
    """Failure: `DefaultLoadPlanner.load_bytes` reads every BYTE_IO record of a `.distcp` file (Megatron's
    ShardedObjects, e.g. each layer's `_extra_state`) with `torch.load(weights_only=False)`: a `.metadata` made
    only of allowed classes could point one record at an appended pickle that ran a command. Fix: the same with
    `weights_only=True` (Megatron's own records, `[None]` and plain containers, load that way). torch 2.13.0,
    megatron-core 0.16.1 (`MCoreLoadPlanner` inherits the method)."""
    from torch.distributed.checkpoint._traverse import set_element  # at apply time (see the module docstring)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # at apply time

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    DefaultLoadPlanner.load_bytes = load_bytes


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (the first address `host` resolves to) and listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _patch_tcp_store_bind_host() -> None:
    """Failure: a `TCPStore` server listens on every interface (`::`, both the libuv and the legacy backend)
    whatever `host_name` it is given, so torchrun's c10d rendezvous store and the agent store its ranks share
    (MASTER_ADDR) listened beyond loopback with a loopback endpoint and `--local-addr 127.0.0.1`. Fix: a server
    (`is_master=True`) gets a socket bound to `host_name:port` (`master_listen_fd`, torch's own option); a bind
    error stays a `DistNetworkError`, so the c10d backend still falls back to being a client when another agent
    hosts the store. Replaced where torch looks the name up: `torch.distributed` (the dynamic rendezvous), and the
    c10d, static and `env://` rendezvous modules, which import it by name. torch 2.13.0."""
    from torch.distributed import rendezvous as env_rendezvous  # at apply time (see the module docstring)
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous  # at apply time

    original = dist.TCPStore

    def tcp_store(host_name, port, world_size=None, is_master=False, *args, **kwargs):
        # master_listen_fd is TCPStore's 8th parameter: the 4th after is_master, if given by position.
        if is_master and kwargs.get("master_listen_fd") is None and len(args) < 4:
            try:
                sock = _listening_socket(host_name, port)
            except OSError as err:
                raise dist.DistNetworkError(f"cannot host a TCPStore on {host_name}:{port}: {err}") from None
            kwargs["master_listen_fd"] = sock.detach()  # the store owns the descriptor from here on
        return original(host_name, port, world_size, is_master, *args, **kwargs)

    tcp_store.original = original  # for tests and for callers that need torch's own
    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous, env_rendezvous):
        module.TCPStore = tcp_store


def gloo_devices(copies: int = 1) -> list:
    """Gloo devices found as torch finds the one it gives each group: one per interface in GLOO_SOCKET_IFNAME if
    set, else one by this host's name; `copies` of each (each device is a TCP connection per peer and a loop
    thread)."""
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    return [
        dist.ProcessGroupGloo.create_device(interface=name) if name else dist.ProcessGroupGloo.create_default_device()
        for _ in range(copies)
        for name in interfaces or [""]
    ]


def _patch_gloo_shared_device() -> None:
    """Failure (a cost): every gloo group torch makes (`init_process_group`, `new_group`) gets a gloo device of its
    own, whose TCP loop thread wakes every 10 ms even when idle, and two worker threads. Megatron-Core makes about
    20 groups per rank: a trainer rank ran 66 threads and its main thread was preempted about 100 times in a
    quickstart train step on 2 cores (about 30 with one device per process; what that costs: docs/benchmarks.md).
    Fix: the groups torch makes share the process's devices (gloo multiplexes their connections on them; each
    group keeps its own connections and worker threads); a group made with explicit options (the weight groups'
    streams) keeps its own. torch 2.13.0."""
    c10d = dist.distributed_c10d
    if hasattr(c10d._new_process_group_helper, "original"):  # applied already (`share_gloo_devices`)
        return
    original_class, original_helper = c10d.ProcessGroupGloo, c10d._new_process_group_helper
    shared: list = []

    class SharedDeviceGloo(original_class):
        """torch's ProcessGroupGloo on the process's shared devices, as torch would make it otherwise."""

        def __init__(self, store, rank, size, timeout=None):
            if not shared:
                shared.extend(gloo_devices())
            options = original_class._Options()
            options._devices = list(shared)
            options._threads = 2 * len(shared)  # torch's default: two per device
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    def new_process_group_helper(*args, **kwargs):
        # Only while torch makes a group: everywhere else `ProcessGroupGloo` stays torch's own class.
        c10d.ProcessGroupGloo = SharedDeviceGloo
        try:
            return original_helper(*args, **kwargs)
        finally:
            c10d.ProcessGroupGloo = original_class

    new_process_group_helper.original = original_helper  # for tests
    c10d._new_process_group_helper = new_process_group_helper


def share_gloo_devices() -> None:
    """Apply only the shared gloo device patch (idempotent): for processes that make gloo groups but load no
    checkpoints and host no TCPStore of ours (vLLM's CPU engines, `parallel/patches/vllm_engine.py`)."""
    _patch_gloo_shared_device()


_TORCH_PATCHES = (
    _patch_dcp_metadata_allow_list, _patch_dcp_bytes_weights_only, _patch_tcp_store_bind_host,
    _patch_gloo_shared_device,
)  # fmt: skip


def apply_torch_patches() -> list[str]:
    """Apply every torch patch once (on every device); return the names applied in this process."""
    if _TORCH_APPLIED:
        return applied_torch_patches()
    for patch in _TORCH_PATCHES:
        patch()
        _TORCH_APPLIED.append(patch.__name__.removeprefix("_patch_"))
    return applied_torch_patches()
