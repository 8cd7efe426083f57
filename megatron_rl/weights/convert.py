"""`megatron-rl convert`: HF safetensors <-> Megatron distributed checkpoint, at any parallel layout.

The parent process checks everything it can before launching workers (family, layout, tensor names), owns the
staging folder, and renames it into place only when every rank finished; a failure leaves no output folder.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from megatron_rl.models import family_for_hf_config, read_hf_config
from megatron_rl.models.hf_checkpoint import HFCheckpoint, staging_folder
from megatron_rl.parallel.layout import ParallelLayout, check_layout_fits_model
from megatron_rl.parallel.torchrun import run_torchrun
from megatron_rl.trainer.checkpoint import read_hf_config_of, read_meta
from megatron_rl.trainer.hf_weights import check_checkpoint_names

WORKER = "megatron_rl.workers.convert"
"""The torchrun worker that converts (`python -m`)."""
TIMING_TAG = "MEGATRON_RL_TIMING"
"""Rank 0 of the worker prints its timings as one JSON object on a line that starts with this."""


def _launch(spec: dict, nproc: int, timeout_s: float) -> dict:
    """Run the worker; return wall seconds (launch included) and the workers' own conversion seconds."""
    with tempfile.TemporaryDirectory(prefix="mrl-convert-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        start = time.perf_counter()
        output = run_torchrun(WORKER, [str(spec_path)], nproc, timeout_s)
        timing = {"wall_seconds": time.perf_counter() - start}
    for line in output.splitlines():
        if line.startswith(TIMING_TAG):
            timing.update(json.loads(line[len(TIMING_TAG) :]))
    return timing


def hf_to_mcore(
    hf_dir: str, out: str, layout: ParallelLayout, overwrite: bool = False, timeout_s: float = 3600.0
) -> dict:
    """Convert a HF checkpoint folder to a Megatron distributed checkpoint, loading it at `layout`."""
    hf_config = read_hf_config(hf_dir)
    family = family_for_hf_config(hf_config, where=f"{hf_dir}/config.json")
    arch = family.arch_from_hf(hf_config, f"{hf_dir}/config.json")
    check_layout_fits_model(layout, arch)
    ckpt = HFCheckpoint(hf_dir)
    check_checkpoint_names(ckpt, family.rule_table(arch))
    with staging_folder(out, overwrite=overwrite, protect=[hf_dir]) as tmp:
        spec = {"direction": "hf-to-mcore", "hf": str(hf_dir), "out": str(tmp), "layout": layout.__dict__}
        timing = _launch(spec, layout.world_size, timeout_s)
    return {"family": family.name, "layout": layout.describe(), "bytes": ckpt.total_bytes(), **timing, "out": str(out)}


def mcore_to_hf(
    mcore_dir: str, out: str, layout: ParallelLayout | None = None, overwrite: bool = False, timeout_s: float = 3600.0
) -> dict:
    """Convert a Megatron distributed checkpoint back to sharded HF safetensors (loaded at `layout`, default 1).

    A LoRA run's checkpoint (its meta names the adapters) is written merged (`W0 + alpha/r B A`), with the
    adapters alone as a PEFT folder in `out/adapter` (`weights/peft_export.py`)."""
    meta = read_meta(mcore_dir)
    hf_config = read_hf_config_of(mcore_dir)
    family = family_for_hf_config(hf_config, where=f"{mcore_dir}/hf/config.json")
    layout = layout or ParallelLayout()
    check_layout_fits_model(layout, family.arch_from_hf(hf_config, f"{mcore_dir}/hf/config.json"))
    with staging_folder(out, overwrite=overwrite, protect=[mcore_dir]) as tmp:
        spec = {"direction": "mcore-to-hf", "mcore": str(mcore_dir), "out": str(tmp), "layout": layout.__dict__}
        spec |= {"lora": meta.get("lora"), "base_hf_path": meta.get("base_hf_path")}  # a LoRA run's checkpoint
        timing = _launch(spec, layout.world_size, timeout_s)
        nbytes = json.loads((tmp / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    return {
        "family": family.name,
        "layout": layout.describe(),
        "bytes": nbytes,
        **timing,
        "out": str(out),
        "source_layout": meta.get("layout"),
        "lora": bool(meta.get("lora")),
    }
