"""Reading and writing Hugging Face safetensors checkpoints (single file or sharded with an index).

Writing is atomic at the folder level: everything goes to a temporary sibling folder that is renamed into place
only when complete, so a failed conversion never leaves a folder that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.models.base import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files a HF checkpoint folder carries beside its weights, copied along by conversions.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
}


_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype codes that `HFCheckpoint` reads itself; tensors of other dtypes go through safetensors."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where one tensor's bytes are in its safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute file offset of the first byte."""
    nbytes: int


def _read_header(path: Path) -> dict[str, _Entry]:
    """Tensor name -> _Entry from a safetensors header (8-byte little-endian length, then JSON).

    Entries whose dtype `_TORCH_DTYPES` lacks or whose byte range disagrees with dtype and shape are left out,
    so they are read through safetensors (which reports a malformed file properly).
    """
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    entries = {}
    for name, info in header.items():
        dtype = _TORCH_DTYPES.get(info.get("dtype")) if name != "__metadata__" else None
        if dtype is None:
            continue
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        numel = 1
        for dim in shape:
            numel *= dim
        if end - begin == numel * dtype.itemsize:
            entries[name] = _Entry(dtype, shape, 8 + length + begin, end - begin)
    return entries


def _pread_into(handle, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous tensor `out` with the file's bytes from `offset` on (short files raise OSError)."""
    if out.numel() == 0:
        return
    buffer = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buffer):
        got = os.preadv(handle.fileno(), [buffer[done:]], offset + done)
        if got == 0:
            raise OSError(f"file ends {len(buffer) - done} bytes early")
        done += got


def _rows_fit(entry: _Entry, out: torch.Tensor, first_row: int) -> bool:
    """Whether rows `first_row ...` of the stored tensor can be read byte for byte into `out`."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != entry.dtype:
        return False
    if out.dim() == 0 or out.dim() != len(entry.shape) or tuple(out.shape[1:]) != entry.shape[1:]:
        return False
    return first_row >= 0 and first_row + out.shape[0] <= entry.shape[0]


class HFCheckpoint:
    """Read-only view of a HF checkpoint folder's tensors, opened lazily file by file.

    Tensors are read with plain positioned reads into freshly allocated (or caller-given) memory rather than
    through safetensors' memory map: on the virtual machines this runs on, touching a file mapping page by page
    costs about ten times a read() of the same bytes, and the copy out of the mapping is made anyway.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a checkpoint folder")
        self._handles: dict[str, object] = {}
        self._files: dict[str, object] = {}
        self._headers: dict[str, dict[str, _Entry]] = {}
        self._file_of = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: unreadable safetensors index ({err})") from None
            for fname in set(weight_map.values()):
                if not (self.folder / fname).exists():
                    raise CheckpointError(f"{index}: names shard {fname}, which is missing from {self.folder}")
            return dict(weight_map)
        single = self.folder / SINGLE_NAME
        if not single.exists():
            raise CheckpointError(f"{self.folder}: no {SINGLE_NAME} and no {INDEX_NAME}")
        return {name: SINGLE_NAME for name in self._open(SINGLE_NAME).keys()}  # noqa: SIM118 (not a dict)

    def _open(self, fname: str):
        if fname not in self._handles:
            path = self.folder / fname
            try:
                self._handles[fname] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path}: unreadable safetensors file ({err})") from None
        return self._handles[fname]

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _entry(self, name: str) -> tuple[str, _Entry | None]:
        """(file name, where the tensor's bytes are, or None to read it through safetensors)."""
        if name not in self._file_of:
            raise CheckpointError(f"{self.folder}: tensor {name} is missing")
        fname = self._file_of[name]
        self._open(fname)  # validates the file, with a CheckpointError naming it
        if fname not in self._headers:
            self._headers[fname] = _read_header(self.folder / fname)
            self._files[fname] = open(self.folder / fname, "rb")  # noqa: SIM115 (kept open for later reads)
        return fname, self._headers[fname].get(name)

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor by name; a CheckpointError names it and its file when that fails."""
        fname, entry = self._entry(name)
        try:
            if entry is None:
                return self._open(fname).get_tensor(name)
            out = torch.empty(entry.shape, dtype=entry.dtype)
            _pread_into(self._files[fname], entry.offset, out)
            return out
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{self.folder / fname}: cannot read tensor {name} ({err})") from None

    def layout_of(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """(shape, dtype) of a tensor from its file header, or None when `read_rows_into` cannot read it."""
        _, entry = self._entry(name)
        return None if entry is None else (entry.shape, entry.dtype)

    def read_rows_into(self, name: str, out: torch.Tensor, first_row: int) -> bool:
        """Read rows `first_row ...` of tensor `name` (as many as `out` has) straight into `out`.

        One copy from the file into the destination, no intermediate tensor. Returns False, reading nothing,
        when that cannot be done: `out` is not a contiguous CPU tensor, dtypes or the trailing dimensions differ,
        or the rows run past the tensor; the caller then takes the general path (which also reports such mismatches).
        """
        fname, entry = self._entry(name)
        if entry is None or not _rows_fit(entry, out, first_row):
            return False
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        try:
            _pread_into(self._files[fname], entry.offset + first_row * row_bytes, out)
        except Exception as err:
            raise CheckpointError(f"{self.folder / fname}: cannot read tensor {name} ({err})") from None
        return True

    def dtype_of(self, name: str) -> str:
        """Torch dtype name (`float32`, `bfloat16`, ...) of a tensor, read from the file header only."""
        code = self._open(self._file_of[name]).get_slice(name).get_dtype()
        return _SAFETENSORS_DTYPES.get(code, code.lower())

    def total_bytes(self) -> int:
        """Sum of the sizes of the weight files."""
        return sum((self.folder / f).stat().st_size for f in set(self._file_of.values()))


def check_tensor_names(ckpt: HFCheckpoint, expected: Iterable[str], ignore_suffixes: tuple[str, ...] = ()) -> None:
    """Raise a CheckpointError listing missing and unexpected tensor names (at most a few of each)."""
    expected = set(expected)
    present = {n for n in ckpt.names() if not n.endswith(ignore_suffixes)}
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} missing tensor(s): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
        if extra:
            parts.append(f"{len(extra)} unexpected tensor(s): {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
            if any(n.endswith(QUANTIZATION_SUFFIXES) for n in extra):
                parts.append(DEQUANTIZE)
        raise CheckpointError(f"{ckpt.folder}: " + "; ".join(parts))


QUANTIZATION_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", ".qweight", ".scales", ".qzeros")
"""Names of the extra tensors a quantized checkpoint (FP8 block scales, GPTQ / AWQ) holds beside its weights."""
DEQUANTIZE = "a quantized checkpoint: dequantize it to bfloat16 or float32 first"
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""What a weight may be stored as: others (FP8, integers) would be cast, silently changing the values."""


def check_weight_dtypes(ckpt: HFCheckpoint, names: Iterable[str]) -> None:
    """Raise a CheckpointError naming the first weight stored in a dtype other than `WEIGHT_DTYPES` (read from the
    file headers only)."""
    for name in names:
        dtype = ckpt.dtype_of(name)
        if dtype not in WEIGHT_DTYPES:
            raise CheckpointError(
                f"{ckpt.folder}: tensor {name} is stored as {dtype}, not {' / '.join(WEIGHT_DTYPES)}"
                + (f"; {DEQUANTIZE}" if "8" in dtype or dtype.startswith(("int", "uint")) else "")
            )


CHECKPOINT_MARKERS = ("config.json", "megatron_rl.json", "model.safetensors.index.json")
"""Files one of which every checkpoint folder this project writes or reads holds."""


def is_checkpoint_folder(folder: str | Path) -> bool:
    """Whether `folder` holds a HF or Megatron checkpoint (so `--overwrite` may replace it)."""
    folder = Path(folder)
    return any((folder / name).is_file() for name in CHECKPOINT_MARKERS) or any(folder.glob("*.safetensors"))


def check_output_folder(out: str | Path, overwrite: bool = False, protect: Iterable[str | Path] = ()) -> Path:
    """The resolved output folder, after refusing what would lose data: a file in its place, a non-empty folder
    without `overwrite`, or replacing a folder that holds the current directory or one of `protect` (a source)."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: output path exists and is not a folder")
    if out.exists():
        if any(out.iterdir()) and not overwrite:
            raise CheckpointError(f"{out}: output folder exists and is not empty (--overwrite replaces it)")
        for kept, what in [(Path.cwd(), "the current directory"), *((Path(p), f"the source {p}") for p in protect)]:
            kept = kept.resolve()
            if kept == out or out in kept.parents:
                raise CheckpointError(f"{out}: refusing to replace the output folder, it holds {what}")
        if any(out.iterdir()) and not is_checkpoint_folder(out):
            raise CheckpointError(
                f"{out}: --overwrite replaces only a checkpoint folder, and this one holds none (no config.json, "
                f"{', '.join(CHECKPOINT_MARKERS[1:])} or *.safetensors): remove it yourself if that is meant"
            )
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staging_folder(out: str | Path, overwrite: bool = False, protect: Iterable[str | Path] = ()) -> Iterator[Path]:
    """A temporary sibling of `out` that becomes `out` only if the block finishes without error.

    See `check_output_folder` for what is refused. The folder gets the permissions of one made by `mkdir`
    (mkdtemp's are 0700, which would hide a checkpoint from the other users and Ray workers of a cluster).
    """
    out = check_output_folder(out, overwrite, protect)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


class ShardedWriter:
    """Writes named tensors into safetensors shards of at most `max_shard_bytes`.

    Alone, `close()` names them `model-0000k-of-0000n.safetensors` and writes the index. Several writers (one per
    rank) use distinct `prefix`es and `finish()`; then `write_index` numbers all their shards at once.
    """

    def __init__(self, folder: Path, max_shard_bytes: int = 2 * 1024**3, prefix: str = "shard"):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes a shard once the budget is reached."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        fname = f"{self.prefix}-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(self.folder / fname), metadata={"format": "pt"})
        self._shards.append((fname, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> tuple[list[tuple[str, list[str]]], int]:
        """Flush what is pending; return ([(temporary file, tensor names)], bytes written)."""
        if self._pending:
            self._flush()
        return list(self._shards), self.total_bytes

    def close(self) -> None:
        """Flush, give the shards their final names and write the index."""
        shards, total = self.finish()
        write_index(self.folder, shards, total)


def write_index(folder: Path, shards: list[tuple[str, list[str]]], total_bytes: int) -> None:
    """Rename temporary shard files to `model-0000k-of-0000n.safetensors` and write the index."""
    folder = Path(folder)
    if not shards:
        raise CheckpointError(f"{folder}: no tensors were written")
    weight_map = {}
    for i, (tmp_name, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(folder / tmp_name, folder / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: str | Path, dst: str | Path) -> None:
    """Copy config and tokenizer files of a HF checkpoint folder (those that exist)."""
    for name in SIDE_FILES:
        path = Path(src) / name
        if path.exists():
            shutil.copy2(path, Path(dst) / name)
