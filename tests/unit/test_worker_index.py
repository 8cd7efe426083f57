"""Which weight-group member an engine worker is: unique across the data-parallel replicas of one engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl.weights.engine.worker import WeightUpdateExtension


def _worker(rank: int, dp_rank: int | None, tp: int) -> WeightUpdateExtension:
    worker = WeightUpdateExtension()
    worker.rank = rank
    if dp_rank is not None:
        parallel = SimpleNamespace(data_parallel_rank=dp_rank, world_size=tp)
        worker.vllm_config = SimpleNamespace(parallel_config=parallel)
    return worker


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)])
def test_every_worker_of_an_engine_has_its_own_index(dp, tp):
    indices = sorted(_worker(rank, replica, tp).mrl_worker_index() for replica in range(dp) for rank in range(tp))
    assert indices == list(range(dp * tp))  # what the pool counts as the engine's workers: tp x dp members


def test_a_worker_without_a_vllm_config_is_its_rank():
    assert _worker(3, None, 1).mrl_worker_index() == 3
