"""Megatron distributed checkpoints (`dist_checkpointing`): saved at one layout, loadable at any other.

A checkpoint folder holds Megatron's own files plus `megatron_rl.json` (family, dtype, source layout) and `hf/`
(the source checkpoint's config.json and tokenizer), so it can be turned back into a HF checkpoint on its own.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import copy_side_files
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.optimizer import unwrap_model

RNG_DIR = "rng"
"""Folder of a checkpoint that holds each rank's RNG state (`rank<N>.pt`)."""

META_NAME = "megatron_rl.json"
HF_SIDE_DIR = "hf"
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
"""DistributedOptimizer state formats (Megatron's `distrib_optim_sharding_type`): `fully_reshardable` gathers each
DP group's state on its DP rank 0 at save and loads at any layout; `dp_reshardable` saves the flat buffers as they
are (fast, no gather) and loads only at the same TP/PP/EP layout (any DP). Megatron 0.16's default,
`fully_sharded_model_space`, cannot be saved: "ShardedTensor.flattened_range is not supported"."""
OPTIMIZER_FORMAT_KEY = "optimizer_format"
"""Key in `megatron_rl.json` naming the format the optimizer state was saved in (absent: no optimizer state)."""


def _sharded_state_dict(model, optimizer=None, optimizer_format: str = "", is_loading: bool = False) -> dict:
    """Model (and optimizer) sharded state; the optimizer's is keyed by the model's sharded tensors.

    The model may be wrapped in DDP: keys come from the GPTModel inside, so wrapped and bare models share
    checkpoints. `is_loading` makes the optimizer allocate its state before a load (Megatron builds it lazily at
    the first step) and build the load-side description of its shards.
    """
    state = {"model": unwrap_model(model).sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state["model"], is_loading=is_loading, metadata={"distrib_optim_sharding_type": optimizer_format}
        )
    return state


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (one per chained optimizer)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [inner.optimizer for inner in chained if getattr(inner, "optimizer", None) is not None]


@torch.no_grad()
def allocate_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its per-parameter state by one update with zero gradients and lr 0 (a no-op).

    Without Apex or Transformer Engine, Megatron's optimizers wrap torch's AdamW, whose state (and its `step`)
    exists only after a first step; the DistributedOptimizer's `state_dict()` then asserts
    `len(steps) == 1` ("AssertionError" on loading into a fresh optimizer, megatron-core 0.16.1). With lr 0 the
    update and the decoupled weight decay leave every parameter unchanged; the loaded state replaces the rest.
    """
    for torch_opt in _torch_optimizers(optimizer):
        # Only torch's own Adam keeps its step in lazily created per-parameter state (not TE/Apex FusedAdam).
        if len(torch_opt.state) > 0 or not isinstance(torch_opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        saved_lrs = [group["lr"] for group in torch_opt.param_groups]
        params = [p for group in torch_opt.param_groups for p in group["params"]]
        for group in torch_opt.param_groups:
            group["lr"] = 0.0
        for param in params:
            param.grad = torch.zeros_like(param)
        try:
            torch_opt.step()
        finally:
            for group, lr in zip(torch_opt.param_groups, saved_lrs):
                group["lr"] = lr
            for param in params:
                param.grad = None


def save_checkpoint(
    model,
    ctx: ParallelContext,
    folder: str | Path,
    meta: dict,
    hf_dir: str | Path | None = None,
    optimizer=None,
    extra: dict | None = None,
    optimizer_format: str = "fully_reshardable",
    sharded_strategy=None,
) -> None:
    """Write this rank's shards to `folder` (all ranks call it); rank 0 adds metadata and the HF side files.

    With `optimizer`, its state is saved too, in `optimizer_format` (see OPTIMIZER_FORMATS); the LR scheduler's
    state belongs in `extra`. `extra` is saved as plain tensors/numbers in a common `extra.pt` by rank 0 (step,
    RNG, data position, ...). `sharded_strategy` is passed to `dist_checkpointing.save` (None: Megatron's
    default torch_dist writer), e.g. the conversion tool's in-process writer.
    """

    if optimizer is not None and optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer_format={optimizer_format!r}: allowed {OPTIMIZER_FORMATS}")
    folder = Path(folder)
    if ctx.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(
        _sharded_state_dict(model, optimizer, optimizer_format), str(folder), sharded_strategy=sharded_strategy
    )
    if optimizer is not None:
        meta = {**meta, OPTIMIZER_FORMAT_KEY: optimizer_format}
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

    Optimizer state saved as `dp_reshardable` loads only at the saving TP/PP/EP layout. Returns the `extra`
    dictionary saved beside it, or None.
    """

    folder = Path(folder)
    optimizer_format = read_meta(folder).get(OPTIMIZER_FORMAT_KEY, "")
    if optimizer is not None and not optimizer_format:
        raise CheckpointError(f"{folder}: holds no optimizer state (saved without optimizer=)")
    if optimizer is not None:
        allocate_optimizer_state(optimizer)
    try:
        state = dist_checkpointing.load(
            _sharded_state_dict(model, optimizer, optimizer_format, is_loading=True), str(folder)
        )
    except Exception as err:  # Megatron raises several types for missing or mismatched shards
        raise CheckpointError(f"{folder}: cannot load distributed checkpoint ({type(err).__name__}: {err})") from None
    unwrap_model(model).load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        # The DistributedOptimizer copies loaded fp32 values into its main parameters, which for fp32 models are
        # views of the (grad-requiring) model parameters: autograd refuses that in-place copy outside no_grad.
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
    extra = folder / "extra.pt"
    return torch.load(extra, weights_only=True) if extra.exists() else None


def rng_state() -> dict:
    """This process's RNG states (torch CPU, CUDA when present, Python); numbers and tensors only."""
    state = {"torch": torch.get_rng_state(), "python": json.dumps(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(folder: str | Path, rank: int) -> None:
    """(Every rank) save this rank's RNG state into the checkpoint."""
    path = Path(folder) / RNG_DIR
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / f"rank{rank}.pt")


def load_rng(folder: str | Path, rank: int) -> bool:
    """(Every rank) restore this rank's RNG state; False when the checkpoint has none for it (another layout)."""
    path = Path(folder) / RNG_DIR / f"rank{rank}.pt"
    if not path.exists():
        return False
    set_rng_state(torch.load(path, weights_only=True))
    return True
