"""Megatron distributed checkpoints (`dist_checkpointing`): saved at one layout, loadable at any other.

A checkpoint folder holds Megatron's own files plus `megatron_rl.json` (family, dtype, source layout) and `hf/`
(the source checkpoint's config.json and tokenizer), so it can be turned back into a HF checkpoint on its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import copy_side_files
from megatron_rl.parallel.groups import ParallelContext

META_NAME = "megatron_rl.json"
HF_SIDE_DIR = "hf"


def _sharded_state_dict(model, optimizer=None) -> dict:
    state = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    return state


def save_checkpoint(
    model,
    ctx: ParallelContext,
    folder: str | Path,
    meta: dict,
    hf_dir: str | Path | None = None,
    optimizer=None,
    extra: dict | None = None,
) -> None:
    """Write this rank's shards to `folder` (all ranks call it); rank 0 adds metadata and the HF side files.

    `extra` is saved as plain tensors/numbers in a common `extra.pt` by rank 0 (step, RNG, data position, ...).
    """
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    if ctx.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(model, optimizer), str(folder))
    if ctx.rank == 0:
        (folder / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if hf_dir is not None:
            (folder / HF_SIDE_DIR).mkdir(exist_ok=True)
            copy_side_files(hf_dir, folder / HF_SIDE_DIR)
        if extra is not None:
            torch.save(extra, folder / "extra.pt")
    dist.barrier()


def read_meta(folder: str | Path) -> dict:
    """The `megatron_rl.json` of a checkpoint folder, with an error naming the folder when it is not one."""
    path = Path(folder) / META_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: not a megatron-rl distributed checkpoint (no {META_NAME})") from None
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None


def read_hf_config_of(folder: str | Path) -> dict:
    """The HF config.json stored inside a distributed checkpoint."""
    path = Path(folder) / HF_SIDE_DIR / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: distributed checkpoint lacks a readable HF config ({err})") from None


def load_checkpoint(model, folder: str | Path, optimizer=None) -> dict | None:
    """Load model (and optimizer) shards for this rank's layout from a checkpoint saved at any layout.

    Returns the `extra` dictionary saved beside it, or None.
    """
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    read_meta(folder)
    try:
        state = dist_checkpointing.load(_sharded_state_dict(model, optimizer), str(folder))
    except Exception as err:  # Megatron raises several types for missing or mismatched shards
        raise CheckpointError(f"{folder}: cannot load distributed checkpoint ({type(err).__name__}: {err})") from None
    model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    extra = folder / "extra.pt"
    return torch.load(extra, weights_only=True) if extra.exists() else None


def copy_hf_side(folder: str | Path, out: str | Path) -> None:
    """Copy the stored HF config/tokenizer files of a distributed checkpoint into `out`."""
    side = Path(folder) / HF_SIDE_DIR
    for path in side.iterdir():
        shutil.copy2(path, Path(out) / path.name)
