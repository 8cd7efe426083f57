"""torchrun worker that loads distributed checkpoints (model only) with the project's `load_checkpoint` and
reports, per folder, the parameter sum or the error, as JSON.

    spec: {"hf": HF folder (the model's config), "folders": [checkpoint folders], "out": report path}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.checkpoint import load_checkpoint
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.workers import run_worker


def body(spec: dict, _startup_s: float) -> None:
    rank = bring_up_from_hf(spec["hf"], ParallelLayout())
    report = {}
    for folder in spec["folders"]:
        with torch.no_grad():
            for param in rank.model.parameters():
                param.zero_()
        try:
            load_checkpoint(rank.model, folder)
            report[folder] = {"sum": sum(float(p.double().sum()) for p in rank.model.parameters())}
        except Exception as err:  # what the user would see, one line
            report[folder] = {"error": f"{type(err).__name__}: {err}"}
    Path(spec["out"]).write_text(json.dumps(report))


if __name__ == "__main__":
    run_worker(body, sys.argv[1:])
