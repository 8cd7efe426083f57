"""torchrun workers of the commands that need a trainer at a layout (convert, verify parity, verify sync), on one
shared life cycle: read the JSON spec named on the command line, join the job's process group (Megatron-Core's
patches applied first), run, tear every process group down, also on failure.

A spec with `cases` runs each case in one launch: the model-parallel groups are rebuilt between cases while the
default process group stays, which saves a process start-up per case.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron.core import parallel_state as ps

from megatron_rl.parallel.groups import destroy_distributed, join_process_group
from megatron_rl.parallel.patches import apply_patches
from megatron_rl.parallel.processes import enable_stack_dumps


def start_up(timeout_s: float = 600.0) -> float:
    """Apply the Megatron-Core patches and join the process group; the seconds it took (the rendezvous waits for
    the slowest rank's start, which is not the work a worker times)."""
    start = time.perf_counter()
    apply_patches()
    join_process_group(timeout_s)
    return time.perf_counter() - start


def run_worker(body: Callable[[dict, float], None], argv: list[str] | None = None) -> None:
    """Read the spec (`argv[0]`, default the command line), start up, run `body(spec, startup_seconds)`, tear down.
    The process writes its stacks on STACK_SIGNAL (`enable_stack_dumps`)."""
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    enable_stack_dumps()  # a hung worker's stacks reach the log before `run_torchrun` kills it at its deadline
    try:
        body(spec, start_up())
    finally:
        destroy_distributed()


def run_cases(run_case: Callable[[dict], None], argv: list[str] | None = None) -> None:
    """`run_worker` for a spec of `cases`: `run_case(case)` for each in order, model-parallel groups rebuilt
    between them."""

    def every_case(spec: dict, _startup_s: float) -> None:
        for case in spec["cases"]:
            run_case(case)
            gc.collect()  # the case's model and optimizer go before the next one is built
            ps.destroy_model_parallel()

    run_worker(every_case, argv)
