"""torchrun worker of tests/distributed/test_stack_dumps.py: two gloo ranks that hang as a stuck trainer does,
rank 0 in a collective that rank 1 never joins, rank 1 elsewhere. Each enables stack dumps, then marks itself
ready (a file `<prefix><rank>`)."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megatron_rl.parallel.processes import enable_stack_dumps


def rank0_waits_in_a_barrier() -> None:
    """Where rank 0 hangs: a collective its peer never joins (gloo's timeout far beyond the test)."""
    dist.barrier()


def rank1_stuck_elsewhere() -> None:
    """Where rank 1 hangs: not in the collective."""
    time.sleep(600)


def main(prefix: str) -> None:
    enable_stack_dumps()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    Path(f"{prefix}{rank}").write_text(str(os.getpid()))
    rank0_waits_in_a_barrier() if rank == 0 else rank1_stuck_elsewhere()


if __name__ == "__main__":
    main(sys.argv[1])
