"""The metrics logger's TensorBoard file, read back with TensorBoard's own reader: every numeric metric of every
step under its flattened tag, one event per step."""

from __future__ import annotations

import pytest

from megatron_rl.metrics.logger import MetricsLogger

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_each_steps_numeric_metrics_are_scalars_under_their_flattened_tags(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=3)
    for step in (1, 2, 3):
        logger.log(step, {"reward": {"mean": 0.25 * step}, "loss/total": -1.5 + step, "skipped": False, "note": "x"})
    logger.close()
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    assert sorted(reader.Tags()["scalars"]) == ["loss/total", "reward/mean"]  # no bools, no strings
    assert [(e.step, e.value) for e in reader.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.value for e in reader.Scalars("loss/total")] == [-0.5, 0.5, 1.5]
    assert len(list((tmp_path / "tb").iterdir())) == 1  # one event file
