"""Where conversions and make-tiny write: refusals that protect data, and the permissions of what lands."""

from __future__ import annotations

import os

import pytest

from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import staging_folder


def test_overwriting_the_current_directory_is_refused_and_keeps_its_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="holds the current directory"), staging_folder(".", overwrite=True):
        pass
    assert (tmp_path / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]  # no staging folder left behind


def test_overwriting_a_folder_that_holds_the_source_is_refused(tmp_path):
    source = tmp_path / "run" / "hf"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    refused = pytest.raises(CheckpointError, match="holds the source")
    with refused, staging_folder(tmp_path / "run", overwrite=True, protect=[source]):
        pass
    assert (source / "config.json").exists()


def test_a_file_in_place_of_the_output_folder_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a folder"), staging_folder(tmp_path / "afile"):
        pass


def test_overwrite_replaces_an_old_output_and_the_result_follows_the_umask(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an old checkpoint
    old_mask = os.umask(0o022)
    try:
        with staging_folder(out, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
    finally:
        os.umask(old_mask)
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert out.stat().st_mode & 0o777 == 0o755


def test_a_failed_block_leaves_neither_output_nor_staging_folder(tmp_path):
    with pytest.raises(RuntimeError), staging_folder(tmp_path / "out") as tmp:
        (tmp / "half.bin").write_text("x")
        raise RuntimeError("conversion failed")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_refuses_a_folder_that_holds_no_checkpoint(tmp_path):
    out = tmp_path / "documents"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(CheckpointError, match="replaces only a checkpoint folder"), staging_folder(out, overwrite=True):
        pass
    assert (out / "thesis.tex").read_text() == "years of work"
