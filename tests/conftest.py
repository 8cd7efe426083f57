"""Shared fixtures: tiny HF checkpoints of every family, made once per test session."""

from __future__ import annotations

import os

import pytest

# Tests start only local Ray clusters: keep them on loopback (see megatron_rl/rollout/ray_utils.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "qwen3")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when CUDA is not available."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A function family -> path of a tiny random HF checkpoint of that family (created on first use)."""
    from megatron_rl.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(make_tiny(family, root / family, seed=0))
        return made[family]

    return get


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    """Keep torch in the test process to one thread so that worker processes get the cores."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
