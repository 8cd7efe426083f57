"""torchrun worker of `verify parity`: load the HF checkpoint at a layout and write Megatron's logprobs."""

from __future__ import annotations

import json
import sys

import torch


def main(spec_path: str) -> None:
    """Bring the rank up from the HF folder, compute logprobs, and let one last-stage rank write them."""
    from megatron_rl.parallel.groups import destroy_distributed
    from megatron_rl.parallel.layout import ParallelLayout
    from megatron_rl.trainer.logprobs import forward_logprobs
    from megatron_rl.trainer.setup import bring_up_from_hf, bring_up_from_mcore

    spec = json.loads(open(spec_path).read())
    layout = ParallelLayout(**spec["layout"])
    if spec.get("mcore"):
        rank = bring_up_from_mcore(spec["mcore"], layout)
    else:
        rank = bring_up_from_hf(spec["hf"], layout)
    tokens = torch.load(spec["tokens"])
    logprobs = forward_logprobs(rank.model, rank.ctx, tokens)
    ctx = rank.ctx
    if logprobs is not None and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        torch.save(logprobs.cpu(), spec["out"])
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
