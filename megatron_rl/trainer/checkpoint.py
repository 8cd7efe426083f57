"""Megatron distributed checkpoints (`dist_checkpointing`): saved at one layout, loadable at any other.

A checkpoint folder holds Megatron's own files plus `megatron_rl.json` (family, dtype, source layout), `hf/`
(the source checkpoint's config.json and tokenizer), so it can be turned back into a HF checkpoint on its own, and
`checksums.json`: the size and SHA-256 of every other file, written last at save and checked before a load, so a
truncated or corrupted file is named instead of loaded (torch reads tensor bytes unchecked). Loading runs no code
from the files: torch_dist's pickled `.metadata` and byte records go through `parallel/patches/torch_distributed.py`,
everything else is `torch.load(weights_only=True)` or JSON. A failed save or load (torch's `CheckpointException`,
a `BaseException`) becomes a CheckpointError naming the folder and, where it can be told, the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import copy_side_files
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.parallel.patches import UnsafeCheckpointError, apply_torch_patches, read_metadata_safely
from megatron_rl.trainer.optimizer import torch_optimizers, unwrap_model

log = logging.getLogger(__name__)

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
CHECKSUMS = "checksums.json"
"""File of a checkpoint folder with the size and SHA-256 of every other file in it."""
CHECKSUM_FORMAT = 1
_HASH_CHUNK = 8 << 20


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


@torch.no_grad()
def allocate_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its per-parameter state by one update with zero gradients and lr 0 (a no-op).

    Without Apex or Transformer Engine, Megatron's optimizers wrap torch's AdamW, whose state (and its `step`)
    exists only after a first step; the DistributedOptimizer's `state_dict()` then asserts
    `len(steps) == 1` ("AssertionError" on loading into a fresh optimizer, megatron-core 0.16.1). With lr 0 the
    update and the decoupled weight decay leave every parameter unchanged; the loaded state replaces the rest.
    """
    for torch_opt in torch_optimizers(optimizer):
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
    try:
        dist_checkpointing.save(
            _sharded_state_dict(model, optimizer, optimizer_format), str(folder), sharded_strategy=sharded_strategy
        )
    except BaseException as err:  # torch's CheckpointException is a BaseException
        _reraise_interrupts(err)
        raise CheckpointError(f"{folder}: saving the distributed checkpoint failed: {_failure(err, folder)}") from None
    if optimizer is not None:
        meta = {**meta, OPTIMIZER_FORMAT_KEY: optimizer_format}
    error = None
    if ctx.rank == 0:
        try:
            _write_side_files(folder, meta, hf_dir, extra)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
            error = f"{folder}: writing its side files failed: {_failure(err, folder)}"
    agree(error)
    seal_checkpoint(folder)


def _write_side_files(folder: Path, meta: dict, hf_dir: str | Path | None, extra: dict | None) -> None:
    """(Rank 0) `megatron_rl.json`, the HF side files and `extra.pt`, each fsynced."""
    write_durably(folder / META_NAME, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    if hf_dir is not None:
        (folder / HF_SIDE_DIR).mkdir(exist_ok=True)
        copy_side_files(hf_dir, folder / HF_SIDE_DIR)
        for path in (folder / HF_SIDE_DIR).iterdir():
            fsync_path(path)
    if extra is not None:
        with open(folder / "extra.pt", "wb") as stream:
            torch.save(extra, stream)
            stream.flush()
            os.fsync(stream.fileno())


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, cut short or differs from the checksum recorded when it was saved (another
    checkpoint of the run may still be sound, unlike a checkpoint that does not fit the model)."""


def agree(error: str | None, kind: type[CheckpointError] = CheckpointError) -> None:
    """(Every rank) raise `kind` with the first rank's error on every rank when any rank had one, so that no rank
    waits at the next collective for a rank that already gave up."""
    errors: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(errors, error)
    else:
        errors = [error]
    first = next((e for e in errors if e), None)
    if first:
        raise kind(first)


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary sibling, fsync it, rename it over `path`, fsync the folder:
    after a crash, readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file or folder (a folder's entries: new names, renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reraise_interrupts(err: BaseException) -> None:
    if isinstance(err, KeyboardInterrupt | SystemExit):
        raise err


def _root_errors(err: BaseException) -> list[BaseException]:
    """The errors behind torch's CheckpointException (one per failed rank), else `err` itself."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    return [err]


def _failure(err: BaseException, folder: Path) -> str:
    """One line on why a save or load failed: the first rank's error, and on a save the free space left."""
    roots = _root_errors(err)
    first = roots[0]
    text = str(first).strip().splitlines()[0] if str(first).strip() else ""
    why = f"{type(first).__name__}: {text}" if text else type(first).__name__
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and len(failures) > 1:
        why += f" (ranks {sorted(failures)} failed)"
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return why
    return why + f"; {free / 2**20:.1f} MiB free on that filesystem"


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
    apply_torch_patches()  # no code from the files runs (a process that loads without init_distributed, too)
    optimizer_format = read_meta(folder).get(OPTIMIZER_FORMAT_KEY, "")
    if optimizer is not None and not optimizer_format:
        raise CheckpointError(f"{folder}: holds no optimizer state (saved without optimizer=)")
    verify_checkpoint(folder)
    if optimizer is not None:
        allocate_optimizer_state(optimizer)
    try:
        state = dist_checkpointing.load(
            _sharded_state_dict(model, optimizer, optimizer_format, is_loading=True), str(folder)
        )
    except BaseException as err:  # torch's CheckpointException is a BaseException; Megatron raises several types
        _reraise_interrupts(err)
        raise CheckpointError(_load_failure(folder, err)) from None
    unwrap_model(model).load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        # The DistributedOptimizer copies loaded fp32 values into its main parameters, which for fp32 models are
        # views of the (grad-requiring) model parameters: autograd refuses that in-place copy outside no_grad.
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
    extra = folder / "extra.pt"
    return _load_tensors(extra) if extra.exists() else None


def _load_tensors(path: Path) -> dict:
    """A `torch.save` file of plain tensors and numbers, with an error naming it when it is not one."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # torch raises several types for damaged or foreign files
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {str(err).splitlines()[0][:300]})") from None


def _load_failure(folder: Path, err: BaseException) -> str:
    """Why a load failed, naming the file: a refused `.metadata` or byte record, a damaged or short file, or the
    error itself. torch reads `.metadata` inside its own error handling (a refused one surfaces as "metadata is
    None"), so it is read again here to say why."""
    problem = metadata_problem(folder)
    if problem:
        return f"{folder}: refusing to load the distributed checkpoint: {problem}"
    roots = _root_errors(err)
    refused = next((e for e in roots if isinstance(e, pickle.UnpicklingError)), None)
    if refused is not None:  # torch.load(weights_only=True) met a global it does not allow
        lines = str(refused).splitlines()
        why = next((line.strip() for line in lines if "Unsupported global" in line), lines[0] if lines else "")
        return f"{folder}: refusing to load the distributed checkpoint: a byte record is not plain data ({why})"
    short = truncated_shards(folder)
    if short:
        return f"{folder}: cannot load the distributed checkpoint: {short[0]}"
    return f"{folder}: cannot load the distributed checkpoint ({_failure(err, folder).split('; ')[0]})"


def metadata_problem(folder: Path) -> str:
    """What is wrong with a torch_dist checkpoint's `.metadata` (missing, damaged, naming what it may not), or ''."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as stream:
            read_metadata_safely(stream)
    except FileNotFoundError:
        return f"{path}: missing"
    except UnsafeCheckpointError as err:
        return f"{path}: {err}"
    except Exception as err:  # truncated or otherwise damaged: unpickling fails in several ways
        return f"{path}: unreadable ({type(err).__name__}: {err})"
    return ""


def truncated_shards(folder: Path) -> list[str]:
    """Shard files of a torch_dist checkpoint that are missing or end before the records `.metadata` puts in them
    (one line each); empty when `.metadata` itself cannot be read safely."""
    try:
        with open(folder / ".metadata", "rb") as stream:
            metadata = read_metadata_safely(stream)
    except Exception:  # metadata_problem says why
        return []
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        path = folder / name
        size = path.stat().st_size if path.exists() else None
        if size is None:
            problems.append(f"{path}: missing")
        elif size < end:
            problems.append(f"{path}: {size} bytes, but its records end at byte {end} (truncated)")
    return problems


def checkpoint_files(folder: str | Path) -> list[str]:
    """Every file of a checkpoint folder (relative POSIX paths, sorted) but the checksums and temporary files."""
    root = Path(folder)
    names = []
    for path in root.rglob("*"):
        if path.is_file() and path.name != CHECKSUMS and not path.name.endswith(".tmp"):
            names.append(path.relative_to(root).as_posix())
    return sorted(names)


def file_digest(path: Path) -> dict:
    """{'bytes': size, 'sha256': hex digest} of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _share(names: list[str]) -> list[str]:
    """This rank's share of the files to hash (all of them outside a process group)."""
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _gathered(part: dict) -> dict:
    """Every rank's dictionary merged (every rank gets the result)."""
    if not dist.is_initialized():
        return part
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {key: value for one in parts for key, value in one.items()}


def read_checksums(folder: str | Path) -> dict[str, dict] | None:
    """The recorded {file: {'bytes', 'sha256'}} of a checkpoint folder; None when it has no `checksums.json`."""
    path = Path(folder) / CHECKSUMS
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKSUM_FORMAT:
        raise CheckpointError(f"{path}: not a checksum list of format {CHECKSUM_FORMAT}")
    return manifest["files"]


def write_checksums(folder: str | Path, files: dict[str, dict]) -> None:
    """(One process) record `files` ({name: file_digest}) as the folder's `checksums.json`, durably."""
    manifest = {"format": CHECKSUM_FORMAT, "algorithm": "sha256", "files": dict(sorted(files.items()))}
    write_durably(Path(folder) / CHECKSUMS, (json.dumps(manifest, indent=1) + "\n").encode())


def seal_checkpoint(folder: str | Path) -> None:
    """(Every rank, after every rank finished writing) hash every file of the folder not yet recorded (the ranks
    share the work) and write `checksums.json` (rank 0)."""
    folder = Path(folder)
    known = read_checksums(folder) or {}
    todo = [name for name in checkpoint_files(folder) if name not in known]
    error = None
    try:
        part = {name: file_digest(folder / name) for name in _share(todo)}
    except OSError as err:
        part, error = {}, f"{folder}: cannot read {err.filename} to record its checksum ({err.strerror})"
    agree(error)
    files = known | _gathered(part)
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            write_checksums(folder, files)
        except OSError as err:
            error = f"{folder}: writing {CHECKSUMS} failed: {_failure(err, folder)}"
    agree(error)


def check_files(folder: Path, files: dict[str, dict], names: list[str]) -> str | None:
    """The first of `names` whose size or SHA-256 differs from `files` (its recorded digest), as a message."""
    for name in names:
        path, want = folder / name, files[name]
        if not path.is_file():
            return f"{path}: missing (the checkpoint was saved with it; {CHECKSUMS})"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path}: {size} bytes, saved with {want['bytes']} (truncated or overwritten; {CHECKSUMS})"
        if file_digest(path)["sha256"] != want["sha256"]:
            return f"{path}: corrupted (its SHA-256 differs from the one recorded at save in {CHECKSUMS})"
    return None


def verify_checkpoint(folder: str | Path) -> None:
    """(Every rank: they share the work) CorruptCheckpointError naming the first file whose size or checksum
    differs from `checksums.json` (or the list itself when unreadable); a folder saved without checksums (before
    they were recorded) loads unchecked, with a warning."""
    folder = Path(folder)
    try:
        files = read_checksums(folder)
    except CheckpointError as err:
        raise CorruptCheckpointError(str(err)) from None
    if files is None:
        log.warning("%s: no %s (saved before checksums were recorded): loading it unchecked", folder, CHECKSUMS)
        return
    agree(check_files(folder, files, _share(sorted(files))), CorruptCheckpointError)


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
    """(Every rank) save this rank's RNG state into the checkpoint (fsynced)."""
    path = Path(folder) / RNG_DIR
    path.mkdir(parents=True, exist_ok=True)
    with open(path / f"rank{rank}.pt", "wb") as stream:
        torch.save(rng_state(), stream)
        stream.flush()
        os.fsync(stream.fileno())


def load_rng(folder: str | Path, rank: int) -> bool:
    """(Every rank) restore this rank's RNG state; False when the checkpoint has none for it (another layout)."""
    path = Path(folder) / RNG_DIR / f"rank{rank}.pt"
    if not path.exists():
        return False
    set_rng_state(_load_tensors(path))
    return True
