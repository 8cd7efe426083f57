"""torchrun worker of `verify parity`: for each case, load a checkpoint at a layout and write Megatron's logprobs.

Several cases of the same world size share one launch (`workers.run_cases`).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.sampling_mask import SamplingMask
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.logprobs import forward_logprobs
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.setup import bring_up_from_hf, bring_up_from_mcore
from megatron_rl.workers import run_cases


def run_case(case: dict) -> None:
    """Bring the rank up for one case, compute logprobs, and let one last-stage rank write them."""
    layout = ParallelLayout(**case["layout"])
    if case.get("mcore"):
        rank = bring_up_from_mcore(case["mcore"], layout)
    else:
        temperature = float(case.get("temperature", 1.0))
        rank = bring_up_from_hf(case["hf"], layout, BuildOptions(logit_temperature=temperature, init_weights=False))
    mask = SamplingMask(int(case.get("top_k", -1)), float(case.get("top_p", 1.0)))
    kept = torch.load(case["kept"]) if case.get("kept") else None  # the engine's kept sets
    logprobs = forward_logprobs(rank.model, rank.ctx, torch.load(case["tokens"]), mask=mask, kept=kept)
    if logprobs is not None and rank.ctx.tp_rank == 0 and rank.ctx.dp_rank == 0:
        torch.save(logprobs.cpu(), case["out"])


if __name__ == "__main__":
    run_cases(run_case)
