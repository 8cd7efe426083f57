"""Launch a module under torchrun on this machine, with a deadline and a clear error when a rank fails.

`python -m megatron_rl.parallel.torchrun TORCHRUN_ARGS...` is torchrun itself (`torch.distributed.run`) with its
TCPStore servers bound to the address they are given (`parallel/patches/torch_distributed.py`): the c10d
rendezvous store to the `--rdzv-endpoint` host, the store the agent shares with its ranks to `--local-addr`.
Plain torchrun listens on every interface for both. Every launch here and in `launch/` goes through it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

from megatron_rl.errors import UserError
from megatron_rl.parallel.processes import STACK_DUMP_WAIT_S, descendants, kill_job, signal_for_stacks

AGENT_MODULE = "megatron_rl.parallel.torchrun"
"""`python -m` this: torchrun with bound stores."""
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""Where torch's gloo groups (and Megatron's) bind; unset, gloo binds the address the host name resolves to."""


KILLED_OUTPUT_WAIT_S = 30
"""How long `run_torchrun` reads a killed job's remaining output."""


class LaunchError(UserError, RuntimeError):
    """A torchrun job failed or ran past its deadline."""


def torchrun_command(module: str, args: list[str], nproc: int) -> list[str]:
    """The command line that runs `python -m module args` on `nproc` local processes (free port, loopback)."""
    return [
        sys.executable, "-m", AGENT_MODULE,
        "--nnodes=1", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1",
        "--max-restarts=0", "--monitor-interval=0.5",
        "-m", module, *args,
    ]  # fmt: skip


def loopback_interface() -> str:
    """The name of this machine's loopback network interface (IFF_LOOPBACK in /sys/class/net), `lo` if unknown."""
    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        try:
            if int(flags.read_text(), 16) & 0x8:
                return flags.parent.name
        except (OSError, ValueError):
            continue
    return "lo"


def loopback_gloo_env(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`env` with gloo bound to the loopback interface unless it names an interface already: processes of a run
    on one machine (a local torchrun job, the engines of a local Ray) talk over loopback only."""
    if not env.get(GLOO_IFNAME_ENV):
        env[GLOO_IFNAME_ENV] = loopback_interface()
    return env


def worker_env(nproc: int) -> dict[str, str]:
    """Environment for worker processes: one compute thread each when they would oversubscribe the CPUs, and
    gloo on loopback (they all run on this machine)."""
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    loopback_gloo_env(env)
    return env


def start_torchrun(module: str, args: list[str], nproc: int, log_path: str | Path) -> subprocess.Popen:
    """Start the module on `nproc` processes in the background (own process group), output to `log_path`."""
    log = open(log_path, "w")  # noqa: SIM115 (the child owns it for its lifetime)
    return subprocess.Popen(
        torchrun_command(module, args, nproc), stdout=log, stderr=subprocess.STDOUT, text=True,
        env=worker_env(nproc), start_new_session=True,
    )  # fmt: skip


def log_failure(log_path: str | Path, module: str, returncode: int) -> LaunchError:
    """A LaunchError with the root cause and tail of a background job's log."""
    text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
    return LaunchError(f"{module} failed (exit {returncode}); log {log_path}:\n{_tail(text)}")


def run_torchrun(module: str, args: list[str], nproc: int, timeout_s: float, log_path: str | Path | None = None) -> str:
    """Run the module on `nproc` processes; return its output, or raise LaunchError with its last lines.

    At the deadline the ranks write their stacks (`signal_for_stacks`), then the agent and every rank are killed,
    so a hung collective cannot outlive the caller.
    """
    cmd = torchrun_command(module, args, nproc)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(nproc), start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        below = descendants(proc)  # now: a rank's children leave the agent's tree if the agent ends meanwhile
        if signal_for_stacks(proc):  # where each rank hung, at the end of the output
            time.sleep(STACK_DUMP_WAIT_S)
        kill_job(proc, below + descendants(proc))  # the ranks too: the output's pipe ends only when they are gone
        try:
            output, _ = proc.communicate(timeout=KILLED_OUTPUT_WAIT_S)
        except subprocess.TimeoutExpired:  # something outside the job holds the pipe: report without the output
            proc.kill()
            output = f"(its output: a process outside the job still held the pipe {KILLED_OUTPUT_WAIT_S} s after)"
        _save_log(log_path, output)
        raise LaunchError(
            f"{module} on {nproc} processes ran past its {timeout_s:.0f} s deadline:\n{_tail(output)}"
        ) from None
    _save_log(log_path, output)
    if proc.returncode != 0:
        raise LaunchError(f"{module} on {nproc} processes failed (exit {proc.returncode}):\n{_tail(output)}")
    return output


_ROOT_CAUSE = re.compile(r"^(\[rank(?P<rank>\d+)\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b.*:")
_KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing")
"""Errors a rank prints because another one died first: never the root cause while another error is there."""


def root_cause(text: str, rank: str | None = None) -> str:
    """The exception line that explains the failure, or '': the first one `rank` (torchrun's first failed rank,
    when known) printed, else the first one any rank printed; either way an error that only reports a peer's
    death (a closed connection) is taken last, since which rank prints first is a race."""
    found = [
        (match["rank"], line.strip())
        for line in text.splitlines()
        if (match := _ROOT_CAUSE.match(line.strip())) and "ChildFailedError" not in line
    ]
    ranked = sorted(
        found, key=lambda item: (any(k in item[1] for k in _KNOCK_ON), rank is not None and item[0] != rank)
    )  # stable: among equals the first printed wins
    return ranked[0][1] if ranked else ""


_FIRST_FAILURE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<code>-?\d+)"
    r".*?traceback\s*:\s*(?P<why>[^\n]*)",
    re.DOTALL,
)


def first_failed_rank(text: str) -> str:
    """torchrun's own verdict on which rank failed first and how, e.g. `rank 1 exited -9: Signal 9 (SIGKILL)
    received by PID 30851`, or '' when the log has no torchrun summary. A rank killed from outside prints no
    exception, so this names it where the other ranks' errors (connection reset by the dead peer) would not."""
    match = _FIRST_FAILURE.search(text)
    if match is None:
        return ""
    why = match["why"].strip()
    why = "" if why.startswith("To enable traceback") else f": {why}"
    return f"rank {match['rank']} exited {match['code']}{why}"


_INPUT_ERRORS = ("CheckpointError", "ConfigError", "LayoutError", "PlanError", "TaskError")
"""Errors about the user's input: their own message says everything, so no traceback tail follows them."""


def _tail(text: str, lines: int = 30) -> str:
    body = "\n".join(ln for ln in text.strip().splitlines() if not ln.lstrip().startswith(("Warning", "warnings.warn")))
    match = _FIRST_FAILURE.search(text)
    cause = root_cause(text, match["rank"] if match else None)
    first = first_failed_rank(text)
    bad_input = any(f"{name}:" in cause for name in _INPUT_ERRORS)
    tail = "" if bad_input else "\n".join(body.splitlines()[-lines:])
    head = "".join(f"{label}: {value}\n" for label, value in (("first failure", first), ("root cause", cause)) if value)
    return head + tail


def _save_log(path: str | Path | None, text: str) -> None:
    if path is not None:
        Path(path).write_text(text)


NODE_IP_ENV = "MRL_NODE_IP"
"""This node's address (set per node by launch/node_env.sh): the agent's `--local-addr` when none is given."""


def agent_argv(argv: list[str], env: MutableMapping[str, str]) -> list[str]:
    """torchrun's arguments with `--local-addr` from MRL_NODE_IP when they name none (torchrun's own default is
    the host's FQDN, whose address may not be the one the cluster network uses)."""
    head = argv[: argv.index("-m")] if "-m" in argv else argv
    if env.get(NODE_IP_ENV) and not any(a == "--local-addr" or a.startswith("--local-addr=") for a in head):
        return [f"--local-addr={env[NODE_IP_ENV]}", *argv]
    return list(argv)


def agent_main(argv: list[str]) -> None:
    """torchrun (`torch.distributed.run.main`) on `argv` (see `agent_argv`), with its TCPStore servers bound to
    their host."""
    from torch.distributed.run import main  # torch: only in the agent, not in every importer of this module

    from megatron_rl.parallel.patches.torch_distributed import apply_torch_patches  # torch: only in the agent

    apply_torch_patches()
    sys.argv[0] = "torchrun"
    main(agent_argv(argv, os.environ))


if __name__ == "__main__":
    agent_main(sys.argv[1:])
