"""Damaged and crafted Megatron checkpoints, loaded for real (torch_dist files written by the project's
conversion, loaded by `load_checkpoint` under torchrun and by `megatron-rl convert mcore-to-hf`):

- a crafted `.metadata` or byte record runs no code (torch unpickles both; patches/torch_distributed.py), even
  when the attacker also rewrote `checksums.json`;
- flipped bytes and a truncated shard are refused, naming the file (checksums written at save; without them,
  the shard sizes against `.metadata`), as one CheckpointError, never torch's BaseException.
"""

from __future__ import annotations

import io
import json
import operator
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.torchrun import run_torchrun
from megatron_rl.trainer.checkpoint import CHECKSUMS, checkpoint_files, file_digest, write_checksums
from megatron_rl.weights.convert import hf_to_mcore

REPO = Path(__file__).resolve().parents[2]


class _Run:
    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _Then:
    """Unpickles to `value` after running `cmd` (so that the load would go on normally: nothing looks wrong)."""

    def __init__(self, cmd: str, value):
        self.cmd, self.value = cmd, value

    def __reduce__(self):
        return (operator.getitem, ((_Run(self.cmd), self.value), 1))


@pytest.fixture(scope="module")
def saved(tiny_dir, tmp_path_factory):
    """A real 1-rank distributed checkpoint of the tiny Qwen3-MoE, with its checksums."""
    out = tmp_path_factory.mktemp("safety") / "mcore"
    hf_to_mcore(tiny_dir("qwen3_moe"), str(out), ParallelLayout())
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _reseal(folder: Path) -> None:
    """What an attacker who controls the folder does too: record the changed files' checksums."""
    write_checksums(folder, {name: file_digest(folder / name) for name in checkpoint_files(folder)})


def _metadata(folder: Path):
    metadata = FileSystemReader(str(folder)).read_metadata()
    metadata.storage_meta = None
    return metadata


def _evil_metadata(folder: Path, marker: Path) -> None:
    metadata = _metadata(folder)
    (folder / ".metadata").write_bytes(pickle.dumps(_Then(f"touch {marker}", metadata)))


def _evil_byte_record(folder: Path, marker: Path) -> None:
    """`.metadata` of allowed classes only, one `_extra_state` record pointed at an appended code-running pickle."""
    metadata = _metadata(folder)
    index = next(i for i in metadata.storage_data if "_extra_state" in i.fqn)
    info = metadata.storage_data[index]
    record = io.BytesIO()
    torch.save(_Then(f"touch {marker}", [None]), record)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as stream:
        stream.write(record.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(record.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _load_all(tiny_dir, tmp_path: Path, folders: list[Path]) -> dict:
    spec, out = tmp_path / "spec.json", tmp_path / "report.json"
    spec.write_text(json.dumps({"hf": tiny_dir("qwen3_moe"), "folders": [str(f) for f in folders], "out": str(out)}))
    run_torchrun("tests.support.checkpoint_load_worker", [str(spec)], 1, timeout_s=600)
    return {Path(k).name: v for k, v in json.loads(out.read_text()).items()}


def test_damaged_and_crafted_checkpoints_are_refused_naming_the_file(saved, tiny_dir, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    shard = next(saved.glob("*.distcp")).name
    cases: dict[str, Path] = {"genuine": _copy(saved, tmp_path / "genuine")}

    cases["evil_meta"] = _copy(saved, tmp_path / "evil_meta")
    _evil_metadata(cases["evil_meta"], markers / "META")
    _reseal(cases["evil_meta"])
    cases["evil_bytes"] = _copy(saved, tmp_path / "evil_bytes")
    _evil_byte_record(cases["evil_bytes"], markers / "BYTES")
    _reseal(cases["evil_bytes"])
    cases["evil_unsealed"] = _copy(saved, tmp_path / "evil_unsealed")  # checksums left as saved
    _evil_metadata(cases["evil_unsealed"], markers / "UNSEALED")

    cases["flipped"] = _copy(saved, tmp_path / "flipped")
    data = bytearray((cases["flipped"] / shard).read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(b ^ 0x40 for b in data[middle : middle + 4096])
    (cases["flipped"] / shard).write_bytes(bytes(data))
    cases["truncated"] = _copy(saved, tmp_path / "truncated")
    os.truncate(cases["truncated"] / shard, len(data) // 2)
    cases["truncated_old"] = _copy(cases["truncated"], tmp_path / "truncated_old")  # saved before checksums
    (cases["truncated_old"] / CHECKSUMS).unlink()

    report = _load_all(tiny_dir, tmp_path, list(cases.values()))
    assert "sum" in report["genuine"], report["genuine"]
    assert sorted(os.listdir(markers)) == [], "a crafted checkpoint ran code"
    assert "CheckpointError" in report["evil_meta"]["error"]
    assert ".metadata" in report["evil_meta"]["error"] and "operator.getitem" in report["evil_meta"]["error"]
    assert "not plain data" in report["evil_bytes"]["error"] and "getitem" in report["evil_bytes"]["error"]
    assert f"{cases['evil_unsealed']}/.metadata: " in report["evil_unsealed"]["error"]  # refused by its checksum
    assert CHECKSUMS in report["evil_unsealed"]["error"]
    assert f"{shard}: corrupted" in report["flipped"]["error"], report["flipped"]
    assert f"{shard}: {len(data) // 2} bytes, saved with {len(data)}" in report["truncated"]["error"]
    assert f"{shard}: {len(data) // 2} bytes, but its records end at byte" in report["truncated_old"]["error"]
    for name in ("evil_meta", "evil_bytes", "truncated_old"):
        assert report[name]["error"].startswith("CheckpointError: "), report[name]
    for name in ("flipped", "truncated", "evil_unsealed"):  # a file that differs from its checksum
        assert report[name]["error"].startswith("CorruptCheckpointError: "), report[name]


def test_convert_refuses_a_crafted_metadata_in_one_line(saved, tmp_path):
    """The reported path: `megatron-rl convert mcore-to-hf` ran the payload and then failed with an
    AttributeError. Now: exit 2, the file named, nothing run, nothing written."""
    folder = _copy(saved, tmp_path / "crafted")
    marker = tmp_path / "PWNED"
    _evil_metadata(folder, marker)
    _reseal(folder)
    cmd = [sys.executable, "-m", "megatron_rl.cli", "convert", "mcore-to-hf", "--mcore", str(folder)]
    result = subprocess.run(
        [*cmd, "--out", str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=600
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()
    output = result.stdout + result.stderr
    assert f"{folder}/.metadata" in output and "refusing to load" in output, output[-3000:]
    assert "Traceback" not in output
