"""Pictures of a run from its `metrics.jsonl`: the reward curve, and a report of where the time went.

`megatron-rl report RUN_DIR` redraws both, also while the run goes on.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: must come before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from megatron_rl.metrics.logger import read_metrics  # noqa: E402


def plot_reward_curve(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Reward mean (and max) per step, from metrics.jsonl, as a PNG."""
    records = [r for r in read_metrics(metrics_path) if "reward/mean" in r]
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward/mean"] for r in records], label="reward mean", color="tab:blue")
    if records and "reward/max" in records[0]:
        ax.plot(steps, [r["reward/max"] for r in records], label="reward max", color="tab:blue", alpha=0.3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("task reward")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "reward")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)


REPORT_PANELS = (
    ("reward", (("reward/mean", "reward"), ("eval/reward_mean", "eval reward"))),
    ("staleness (versions)", (("staleness/mean", "mean"), ("staleness/max", "max"))),
    ("idle fraction", (("time/trainer_idle_frac", "trainer"), ("time/engine_idle_frac", "engines"))),
    (
        "tokens / s",
        (("throughput/trained_tokens_per_s", "trained"), ("throughput/generated_tokens_per_s", "generated")),
    ),
    ("seconds", (("time/step_s", "step"), ("sync/seconds", "weight sync"), ("time/data_wait_s", "waiting for data"))),
    ("train vs rollout", (("mismatch/k3_kl", "mismatch k3 KL"),)),
)
"""(panel title, ((metric, label), ...)) of `report.png`; a metric no record has is left out."""


def plot_report(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """`report.png`: reward and eval score, staleness, trainer and engine idle fractions, trained and generated
    tokens/s, step, sync and data-wait seconds, and train-vs-rollout mismatch, over steps."""
    records = read_metrics(metrics_path)
    fig, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    for ax, (panel, series) in zip(axes.flat, REPORT_PANELS):
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), label=label, marker="." if len(points) < 30 else None)
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(title or "run report")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
