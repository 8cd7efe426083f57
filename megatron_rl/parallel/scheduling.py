"""Linux's SCHED_BATCH policy for a run's compute processes on a CPU host.

On a small CPU machine the trainer's ranks and the engines share the cores. Under the default policy every thread
that wakes (a gloo transfer, a collective's other side, a Ray message) may preempt whichever compute thread holds
the core; SCHED_BATCH tells the scheduler the thread is CPU-bound and not to preempt on its wake-ups, so each
process keeps its core for its time slice (nice values and fair shares stay as they are). Switching between the
default policy and this one needs no privilege. Measured: docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def use_batch_scheduling() -> int:
    """Put every thread of this process under SCHED_BATCH; threads started later inherit it from the thread that
    starts them. Returns the number of threads switched: 0 where the platform has no SCHED_BATCH; where it refuses
    a thread, that thread and the ones not yet switched keep their policy and the run goes on."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not os.path.isdir("/proc/self/task"):
        return 0
    switched = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
            switched += 1
        except ProcessLookupError:  # the thread ended since the listing
            continue
        except OSError as err:  # a seccomp profile or a real-time thread: nothing to gain by failing the run
            log.warning("thread %s refused SCHED_BATCH (%s): it and the threads after it keep their policy", tid, err)
            return switched
    return switched
