"""Torchrun worker of tests/distributed/test_group_timeouts.py: every process group `init_distributed` makes
(torch's world and Megatron-Core's) carries the timeout it was given, and a collective a peer never joins on one
of Megatron's groups raises within it."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.parallel.groups import init_distributed
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.processes import enable_stack_dumps

TIMEOUT_S = 5.0  # not a whole number of minutes: Megatron takes its groups' timeout in minutes


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def main(out: str) -> None:
    """Rank 1 records each group's timeout and how long an all-reduce on the TP group took to fail while rank 0
    sat it out; rank 1 writes the report, then both exit without a teardown (the group is broken)."""
    enable_stack_dumps()  # a hung worker's stacks reach the log before run_torchrun kills it
    init_distributed(ParallelLayout(tp=2), timeout_s=TIMEOUT_S)
    groups = {
        "world": dist.group.WORLD,
        "tp": ps.get_tensor_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp_gloo": ps.get_data_parallel_group_gloo(),
        "expert_dp_gloo": ps.get_expert_data_parallel_group_gloo(),  # Megatron made it without its timeout
    }
    report = {"timeouts": {name: _timeout_s(group) for name, group in groups.items()}}
    if dist.get_rank() == 0:
        time.sleep(TIMEOUT_S + 2)  # never joins the all-reduce below
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(1), group=groups["tp"])
            report["raised"] = None
        except (RuntimeError, dist.DistError) as err:
            report["raised"] = type(err).__name__
        report["failed_after_s"] = time.monotonic() - start
        with open(out, "w") as f:
            json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
