"""Rewards: built-in math rewards (`math`: math-verify), user functions in any of three calling conventions (ours,
verl's `compute_score`, TRL's batch functions; plain or `async`), several of them with weights, and DAPO's overlong
and a linear length penalty around any of them. See docs/data.md."""

from __future__ import annotations

from collections.abc import Callable

from megatron_rl.config.task import TaskConfig
from megatron_rl.rollout.rewards.calling import BUILTIN_REWARDS, RewardFunction, describe, load_reward
from megatron_rl.rollout.rewards.combined import InlineRunner, RewardFailure, RewardRunner, RewardSet, Scored
from megatron_rl.rollout.rewards.math import basic_math_reward, math_reward, math_verify_reward
from megatron_rl.rollout.rewards.shaping import LengthPenalty, OverlongPenalty
from megatron_rl.rollout.types import TaskError

__all__ = [
    "BUILTIN_REWARDS", "InlineRunner", "LengthPenalty", "OverlongPenalty", "RewardFailure", "RewardFunction",
    "RewardRunner", "RewardSet", "Scored", "basic_math_reward", "configured_functions", "describe", "load_reward",
    "math_reward", "math_verify_reward", "shapers",
]  # fmt: skip


def configured_functions(cfg: TaskConfig) -> list[RewardFunction]:
    """The reward functions `task.reward` / `task.rewards` name, loaded and told apart (empty: none configured)."""
    functions = []
    for i, spec in enumerate(cfg.reward_specs()):
        fn = load_reward(spec.fn)
        name = spec.name or (spec.fn if spec.fn in BUILTIN_REWARDS else getattr(fn, "__name__", f"reward_{i}"))
        functions.append(describe(fn, name, spec.weight, source=spec.fn))
    names = [f.name for f in functions]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TaskError(f"task.rewards: the names {repeated} repeat; give each a task.rewards[].name")
    return functions


def shapers(cfg: TaskConfig, max_new_tokens: int) -> list[Callable[[int], float]]:
    """The length penalties the config switches on; `max_new_tokens` (the engines' limit) stands in for a
    `max_tokens` of 0."""
    out: list[Callable[[int], float]] = []
    over, length = cfg.overlong_penalty, cfg.length_penalty
    if over.buffer_tokens and over.max_tokens > max_new_tokens:
        raise TaskError(
            f"task.overlong_penalty.max_tokens={over.max_tokens} is above rollout.max_new_tokens={max_new_tokens}: no"
            " response is that long, so the penalty would never apply (0: the engines' limit)"
        )
    try:
        if over.buffer_tokens:
            out.append(OverlongPenalty(over.buffer_tokens, over.max_tokens or max_new_tokens, over.factor))
        if length.coef:
            out.append(LengthPenalty(length.coef, length.max_tokens or max_new_tokens, length.free_tokens))
    except ValueError as err:
        raise TaskError(f"task.{'overlong' if 'overlong' in str(err) else 'length'}_penalty: {err}") from None
    return out
