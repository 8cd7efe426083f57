"""torchrun worker of `megatron-rl convert` (one direction per launch, chosen by the spec file)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import LoraConfig
from megatron_rl.models import read_hf_config
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.checkpoint import HF_SIDE_DIR, load_checkpoint, read_hf_config_of, read_meta, save_checkpoint
from megatron_rl.trainer.hf_weights import load_hf_into_model
from megatron_rl.trainer.lora import add_lora
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.save_strategy import InProcessTorchDistSaveStrategy
from megatron_rl.trainer.setup import bring_up, bring_up_from_mcore
from megatron_rl.weights.convert import TIMING_TAG
from megatron_rl.weights.export import hf_dtypes, write_hf_checkpoint
from megatron_rl.weights.peft_export import PEFT_EXPORT_DIR, export_peft_adapter
from megatron_rl.workers import run_worker

PHASES: dict[str, float] = {}


def hf_to_mcore(spec: dict) -> None:
    """Load the HF checkpoint into this rank's shards, then save a distributed checkpoint."""
    with phase("headers"):
        hf_config = read_hf_config(spec["hf"])
        ckpt = HFCheckpoint(spec["hf"])
        dtypes = hf_dtypes(ckpt)
    model_dtype = "bfloat16" if "bfloat16" in dtypes.values() else "float32"
    with phase("build"):
        opts = BuildOptions(dtype=model_dtype, init_weights=False)
        # No optimizer is built, so Megatron's gloo copies of the data-parallel groups would go unused.
        rank = bring_up(hf_config, ParallelLayout(**spec["layout"]), opts, gloo_groups=False)
    with phase("load"):
        load_hf_into_model(rank.model, ckpt, rank.family, rank.arch, rank.ctx, progress=rank.ctx.rank == 0)
    meta = {"family": rank.family.name, "dtype": model_dtype, "layout": rank.ctx.layout.describe(), "hf_dtypes": dtypes}
    with phase("save"):
        # A one-shot save: Megatron's default writer would start a Manager and fork writer processes (seconds).
        strategy = InProcessTorchDistSaveStrategy()
        save_checkpoint(rank.model, rank.ctx, spec["out"], meta, hf_dir=spec["hf"], sharded_strategy=strategy)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's seconds to PHASES[name] (reported by rank 0 beside the total)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - start


def mcore_to_hf(spec: dict) -> None:
    """Load the distributed checkpoint at this layout; every owner rank writes its tensors; rank 0 indexes."""
    meta = read_meta(spec["mcore"])
    lora = LoraConfig(**spec["lora"]) if spec.get("lora") else None
    if lora is None:
        rank = bring_up_from_mcore(spec["mcore"], ParallelLayout(**spec["layout"]))
    else:  # the model with its adapters (local spec), then the checkpoint: written merged, and the PEFT adapter
        opts = BuildOptions(dtype=meta["dtype"], init_weights=False, use_te=False)
        rank = bring_up(read_hf_config_of(spec["mcore"]), ParallelLayout(**spec["layout"]), opts)
        add_lora(rank.model, lora, rank.family, rank.arch, rank.ctx)
        load_checkpoint(rank.model, spec["mcore"])
    hf_side = Path(spec["mcore"]) / HF_SIDE_DIR
    write_hf_checkpoint(rank.model, rank.family, rank.arch, rank.ctx, spec["out"], hf_side, meta.get("hf_dtypes"))
    if lora is not None:
        base = spec.get("base_hf_path") or str(hf_side)
        out = Path(spec["out"]) / PEFT_EXPORT_DIR
        export_peft_adapter(rank.model, rank.family, rank.arch, rank.ctx, lora, out, base)


def convert(spec: dict, startup_s: float) -> None:
    """Run the direction named in the spec; rank 0 prints the slowest rank's seconds (start-up, the imports and
    the rendezvous, is reported apart: it is not conversion work)."""
    start = time.perf_counter()
    {"hf-to-mcore": hf_to_mcore, "mcore-to-hf": mcore_to_hf}[spec["direction"]](spec)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        phases = {f"{k}_seconds": round(v, 3) for k, v in PHASES.items()}
        timing = {"convert_seconds": seconds.item(), "startup_seconds": round(startup_s, 3), **phases}
        print(f"{TIMING_TAG} {json.dumps(timing)}", flush=True)


if __name__ == "__main__":
    run_worker(convert)
