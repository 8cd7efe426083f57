"""The task's section: prompts and rewards."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_rl.config.base import Section


class TaskConfig(Section):
    """Prompts and reward."""

    name: Literal["count", "copy", "jsonl", "parquet"] = "count"
    """Built-in task (`count`, `copy`), or `jsonl`/`parquet` for a dataset file."""
    path: str = ""
    """Dataset file for `jsonl`/`parquet` tasks."""
    reward: str = ""
    """Dotted path of a reward function `fn(response, answer, sample) -> float` (empty: the task's own)."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Longest one reward call may take; past it the sample's reward is NaN (a failed reward, counted and logged)
    and the call's thread is left to finish (Python cannot stop it)."""
    prompt_key: str = "prompt"
    """Dataset column holding the prompt."""
    answer_key: str = "answer"
    """Dataset column holding the reference answer."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this are skipped and counted."""
    seed: int = 0
    """Seed of prompt generation and dataset shuffling."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the dataset (empty: endless)."""
    length: int = Field(8, ge=1)
    """Target response length of the built-in tasks."""
    max_bad_reward_groups_in_a_row: int = Field(32, ge=1)
    """Groups dropped in a row because a reward raised or was not a finite number before the run stops (a reward
    function that always fails is a bug, not noise); single failures are counted and the run goes on."""
