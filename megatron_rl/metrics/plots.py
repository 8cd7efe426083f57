"""Pictures of a run from its `metrics.jsonl`: the reward curve."""

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
