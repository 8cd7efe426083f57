"""Linux's SCHED_BATCH policy for a run's compute processes on a CPU host.

On a small CPU machine the trainer's ranks and the engines share the cores. Under the default policy a thread that
wakes (a gloo transfer, a collective's other side, a Ray message) may preempt whichever compute thread holds the
core; a thread under SCHED_BATCH does not preempt anything when it wakes (the scheduler takes it for CPU-bound), so
the running compute keeps its core for its time slice (nice values and fair shares stay as they are). Whether a
wake-up preempts depends on the policy of the thread that wakes, so the trainer's ranks and the engines each take
it. Switching between the default policy and this one needs no privilege. Measured: docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def use_batch_scheduling() -> int:
    """Put every thread of this process under SCHED_BATCH; threads started later inherit it from the thread that
    starts them (the listing is repeated until it shows no thread not yet seen, for threads started meanwhile).
    Returns the number of threads switched: 0 where the platform has no SCHED_BATCH. A thread the kernel refuses
    (one under SCHED_IDLE without the nice limit to leave it, or a seccomp profile) keeps its policy, with a
    warning; the others are switched all the same."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return 0
    seen: set[int] = set()
    switched = 0
    while new := {int(tid) for tid in os.listdir("/proc/self/task")} - seen:
        seen |= new
        for tid in sorted(new):
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                switched += 1
            except ProcessLookupError:  # the thread ended since the listing
                continue
            except OSError as err:  # nothing to gain by failing the run: this thread stays as it is
                log.warning("thread %s refused SCHED_BATCH (%s): it keeps its policy", tid, err)
    return switched


def place_process(cores: list[int], batch_scheduling: bool, field: str = "cpu_affinity") -> None:
    """Run this process on `cores` (empty: where it runs now; `field` names them in the error) and, when
    `batch_scheduling`, under SCHED_BATCH: what a trainer rank or an engine does before its process groups and
    threads exist (they inherit both)."""
    if cores:
        try:
            os.sched_setaffinity(0, set(cores))
        except (OSError, ValueError) as err:
            usable = sorted(os.sched_getaffinity(0))
            raise ValueError(
                f"{field}={sorted(set(cores))}: this process cannot run there ({err}); the cores it may use here: "
                + ", ".join(map(str, usable))
            ) from None
    if batch_scheduling:
        use_batch_scheduling()
