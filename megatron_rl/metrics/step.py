"""What is measured each training step (rank 0 of the trainer): the batch's rollout figures, the step's own
stats, the weight sync, the buffer, and the engines' idle time and generation rate from their own counters."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import ray
import torch

from megatron_rl.rollout.teacher import LATENCY_KEY, VERSION_KEY
from megatron_rl.rollout.types import Group


def rollout_stats(groups: list[Group], trainer_version: int) -> dict:
    """Reward, length and staleness figures of a batch of groups, and the share of its groups whose rewards are
    all equal (they give every sample advantage 0: no gradient)."""
    samples = [s for g in groups for s in g.samples]
    flat = sum(len(set(g.rewards)) == 1 for g in groups)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    staleness = Counter(g.staleness(trainer_version) for g in groups)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "reward/max": float(rewards.max()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "rollout/groups": len(groups),
        "rollout/samples": len(samples),
        "rollout/tokens": int(lengths.sum()),
        "staleness/mean": sum(k * v for k, v in staleness.items()) / max(1, len(groups)),
        "staleness/max": max(staleness) if staleness else 0,
        "staleness/histogram": {str(k): v for k, v in sorted(staleness.items())},
        "rollout/stale_corrected": sum(bool(g.stale) for g in groups),
        "batch/zero_variance_frac": flat / max(1, len(groups)),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / max(1, len(samples)),
        **reward_components(samples),
        **teacher_latency(groups),
        **teacher_versions(groups),
    }


def teacher_latency(groups: list[Group]) -> dict:
    """`distill/teacher_latency_s` (mean) and `_max_s`: the seconds the teacher took to score each group of the
    batch (one call per group, beside its rewards); {} without distillation."""
    seconds = [g.samples[0].metadata[LATENCY_KEY] for g in groups if g.samples and LATENCY_KEY in g.samples[0].metadata]
    if not seconds:
        return {}
    return {"distill/teacher_latency_s": sum(seconds) / len(seconds), "distill/teacher_latency_max_s": max(seconds)}


def teacher_versions(groups: list[Group]) -> dict:
    """`distill/teacher_version` (mean) and `_min`: the teacher weight versions that scored the batch's groups (0
    for a fixed teacher; a snapshot teacher's follows the policy every `distill.refresh_every` steps)."""
    versions = [
        g.samples[0].metadata[VERSION_KEY] for g in groups if g.samples and VERSION_KEY in g.samples[0].metadata
    ]
    if not versions:
        return {}
    return {"distill/teacher_version": sum(versions) / len(versions), "distill/teacher_version_min": min(versions)}


_REWARD_KEYS = ("mean", "std", "max")


def reward_components(samples: list) -> dict:
    """`reward/<name>`: the batch mean of each reward component (each reward function's value and each length
    penalty, in `sample.metadata["rewards"]`), over the samples that have it; a component named like one of the
    reward's own figures (mean, std, max) is `reward/<name>_component`."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for name, value in sample.metadata.get("rewards", {}).items():
            values.setdefault(name, []).append(float(value))
    return {
        f"reward/{name}_component" if name in _REWARD_KEYS else f"reward/{name}": sum(v) / len(v)
        for name, v in sorted(values.items())
    }


class ZeroVarianceShare:
    """The share of zero-variance groups among the groups the buffer screened since the previous step, whether
    or not dynamic sampling dropped them (from the buffer's cumulative counters)."""

    def __init__(self):
        self.seen = self.flat = 0

    def measure(self, buffer_stats: dict) -> dict:
        """Metrics since the previous call: `dynamic/zero_variance_frac` and the counters themselves."""
        seen, flat = buffer_stats.get("groups_screened", 0), buffer_stats.get("zero_variance_groups", 0)
        share = (flat - self.flat) / (seen - self.seen) if seen > self.seen else 0.0
        self.seen, self.flat = seen, flat
        return {
            "dynamic/zero_variance_frac": share,
            "dynamic/zero_variance_groups": flat,
            "dynamic/dropped": buffer_stats.get("dropped_by_reason", {}).get("zero_variance", 0),
            "dynamic/kept_past_bound": buffer_stats.get("zero_variance_kept", 0),
        }


def collect_metrics(
    groups, stats: dict, sync_report: dict, buffer, version: int, t_data: float, step_s: float,
    zero_variance: ZeroVarianceShare | None = None,
) -> dict:  # fmt: skip
    """Everything logged for one step (rank 0)."""
    buffer_stats = ray.get(buffer.stats.remote(), timeout=60)
    dynamic = zero_variance.measure(buffer_stats) if zero_variance is not None else {}
    tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    return {
        **rollout_stats(groups, version - 1),
        **{k: v for k, v in stats.items() if isinstance(v, (int, float))},
        "version": version,
        "sync/seconds": sync_report["seconds"],
        "sync/received_bytes": received_bytes(sync_report),
        "time/step_s": step_s,
        "time/data_wait_s": t_data,
        "time/trainer_idle_frac": t_data / step_s if step_s else 0.0,
        "throughput/trained_tokens_per_s": tokens / step_s if step_s else 0.0,
        "buffer/buffered": buffer_stats.get("buffered"),
        "buffer/in_flight": buffer_stats.get("in_flight"),
        "buffer/dropped": buffer_stats.get("dropped"),
        "buffer/dropped_by_reason": buffer_stats.get("dropped_by_reason"),
        **_lookahead(buffer_stats),
        **dynamic,
    }


def received_bytes(sync_report: dict) -> int:
    """The most bytes one engine worker received in the step's weight push (0 when nothing was pushed): a full
    update's weights, or with LoRA the adapters alone."""
    workers = [w for e in sync_report.get("engines", {}).values() for w in e.get("workers", [])]
    return max((int(w.get("bytes", 0)) for w in workers), default=0)


def _lookahead(buffer_stats: dict) -> dict:
    """`buffer/lookahead` when the buffer sizes it (async mode, `buffer.lookahead: adaptive`), else nothing."""
    prompts = buffer_stats.get("lookahead_prompts")
    return {} if prompts is None else {"buffer/lookahead": prompts}


class EngineMeter:
    """Engine idle fraction and generated tokens/s between two calls, from the engines' own counters.

    An engine that does not answer (dead, being restarted) is left out; a restarted one's counters start at 0.
    """

    KEYS = ("time/engine_idle_frac", "throughput/generated_tokens_per_s", "engines/answering")
    """The metric names of the idle fraction, the generation rate and the answering engines."""

    def __init__(self, handles: Callable[[], list], keys: tuple[str | None, str | None, str | None] = KEYS):
        self.handles = handles
        self.keys = keys
        """`KEYS`' names for these engines (None leaves a figure out)."""
        self.last_time, self.last = time.perf_counter(), self._snapshot()

    def _snapshot(self) -> dict[str, tuple[float, float]]:
        counters = {}
        for handle in self.handles():
            try:
                report = ray.get(handle.actor.health.remote(), timeout=10)
            except Exception:  # a dead engine: the supervisor restarts it; metrics go on without it
                continue
            counters[handle.name] = (report["busy_seconds"], report["generated_tokens"])
        return counters

    def measure(self) -> dict:
        """Metrics since the previous call."""
        now_time, now = time.perf_counter(), self._snapshot()
        wall = max(1e-9, now_time - self.last_time)
        busy = tokens = 0.0
        for name, (b, t) in now.items():
            b0, t0 = self.last.get(name, (0.0, 0.0))
            restarted = b < b0 or t < t0
            busy += b if restarted else b - b0
            tokens += t if restarted else t - t0
        self.last_time, self.last = now_time, now
        figures = (max(0.0, 1.0 - busy / (wall * max(1, len(now)))), tokens / wall, len(now))
        return {key: value for key, value in zip(self.keys, figures) if key is not None}
