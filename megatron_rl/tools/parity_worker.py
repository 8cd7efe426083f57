"""torchrun worker of `verify parity`: for each case, load a checkpoint at a layout and write Megatron's logprobs.

Several cases of the same world size share one launch: model-parallel groups are torn down and rebuilt between
cases while the default process group stays, which saves the process start-up per case.
"""

from __future__ import annotations

import sys

import torch

from megatron_rl.tools.cases import run_cases


def run_case(case: dict) -> None:
    """Bring the rank up for one case, compute logprobs, and let one last-stage rank write them."""
    from megatron_rl.parallel.layout import ParallelLayout
    from megatron_rl.trainer.logprobs import forward_logprobs
    from megatron_rl.trainer.model import BuildOptions
    from megatron_rl.trainer.setup import bring_up_from_hf, bring_up_from_mcore

    layout = ParallelLayout(**case["layout"])
    if case.get("mcore"):
        rank = bring_up_from_mcore(case["mcore"], layout)
    else:
        temperature = float(case.get("temperature", 1.0))
        rank = bring_up_from_hf(case["hf"], layout, BuildOptions(logit_temperature=temperature, init_weights=False))
    logprobs = forward_logprobs(rank.model, rank.ctx, torch.load(case["tokens"]))
    if logprobs is not None and rank.ctx.tp_rank == 0 and rank.ctx.dp_rank == 0:
        torch.save(logprobs.cpu(), case["out"])


def main(spec_path: str) -> None:
    """Run every case of the spec file in order."""
    run_cases(spec_path, run_case)


if __name__ == "__main__":
    main(sys.argv[1])
