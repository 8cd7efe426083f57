"""Fixtures of the multi-process tests."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture()
def local_ray():
    """A local Ray head on loopback with 2 CPUs for the test, shut down after it."""
    ray = pytest.importorskip("ray")
    from megatron_rl.rollout.ray_utils import start_local_ray

    temp_dir = tempfile.mkdtemp(prefix="mrl-ray-", dir="/tmp")  # Ray's socket paths must stay short
    start_local_ray(num_cpus=2, temp_dir=temp_dir)
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
