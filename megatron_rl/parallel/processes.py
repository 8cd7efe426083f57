"""Process lifetimes: where a hung process is (its stacks, on a signal), ending a torchrun job with every rank in
it, and helper processes that end with the process that started them.

torchrun's agent starts each rank in a session of its own, so its process group does not hold the ranks: a job is
stopped through the agent (which passes SIGTERM on) and then every process that was under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import subprocess
import time

import psutil

STACK_SIGNAL = signal.SIGUSR1
"""On it, a process that called `enable_stack_dumps` writes every thread's Python stack to its stderr."""
STACK_DUMP_WAIT_S = 2.0
"""How long a job's ranks get to write their stacks before they are killed."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate a background job's whole process group (torchrun's agent passes it on to its ranks), killing it
    after `grace_s`, then kill whatever was under it and is still there after another `grace_s`."""
    if proc.poll() is not None:
        return
    below = descendants(proc)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        kill_job(proc, below)
        proc.wait()
    _, alive = psutil.wait_procs(below, timeout=grace_s)
    _kill_all(alive)


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process under a job's agent: torchrun starts each rank in a session of its own, so the agent's process
    group does not hold them (and once the agent is gone they cannot be found from it)."""
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_job(proc: subprocess.Popen, below: list[psutil.Process]) -> None:
    """SIGKILL the agent's process group and the processes `below` it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _kill_all(below)


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def enable_stack_dumps() -> None:
    """Write every thread's Python stack to stderr on STACK_SIGNAL (`kill -USR1 <pid>`; the launcher sends it to
    a lost trainer's ranks before killing them). faulthandler writes from the signal handler itself, so a process
    stuck in C code, or holding the GIL, still answers."""
    faulthandler.register(STACK_SIGNAL, all_threads=True, chain=False)


def signal_for_stacks(proc: subprocess.Popen, between_s: float = 0.3) -> list[int]:
    """Send STACK_SIGNAL to the ranks of a running torchrun job (the agent `proc`'s child processes) that handle it
    (`enable_stack_dumps`), in the order of their RANK, `between_s` apart so that their dumps into the one log do
    not interleave; the pids signalled (none once the job has ended). The signal's default action would end a
    process, so the agent, and a rank that has not enabled the dumps (yet), are left alone."""
    if proc.poll() is not None:
        return []
    try:
        children = sorted(psutil.Process(proc.pid).children(), key=_rank_of)
    except psutil.Error:
        return []
    sent = []
    for child in children:
        if not handles(child.pid, STACK_SIGNAL):
            continue
        if sent:
            time.sleep(between_s)
        with contextlib.suppress(psutil.Error):
            child.send_signal(STACK_SIGNAL)
            sent.append(child.pid)
    return sent


def handles(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (its SigCgt mask in /proc; False where it cannot
    be read)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def _rank_of(process: psutil.Process) -> int:
    try:
        return int(process.environ().get("RANK", 1 << 30))
    except (psutil.Error, ValueError):
        return 1 << 30


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when the thread that started it ends (Linux; elsewhere nothing); exit at
    once if `parent` (its pid) is gone already. Called first thing in a helper process."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent went before the request took hold
        os._exit(0)
