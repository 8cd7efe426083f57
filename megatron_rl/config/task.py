"""The task's section: prompts (built-in generators or datasets, mixed by weight), evaluation data, rewards."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Section


class DatasetConfig(Section):
    """One dataset: a jsonl/parquet file, a folder of them (or one `save_to_disk` wrote), or a Hugging Face
    dataset name (read with `datasets.load_dataset`, from the local cache when the Hub cannot be reached)."""

    path: str
    """File, folder, or Hugging Face dataset name (`org/name`)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """How to read `path`: by its suffix (`auto`: `.jsonl`/`.json` -> jsonl, `.parquet` -> parquet, a folder or a
    name -> `hf`), or as given."""
    subset: str = ""
    """Configuration (subset) of a Hugging Face dataset (empty: its default)."""
    split: str = "train"
    """Split of a Hugging Face dataset or folder."""
    weight: float = Field(1.0, gt=0)
    """Share of this dataset in a mix: each epoch holds (sum of all usable rows) x weight / (sum of weights) of
    its rows, a dataset with more weight than rows repeating them (reshuffled), one with less visiting a part."""
    prompt_key: str | None = None
    """Column of the prompt (text, or chat messages); dots reach into nested columns (empty: task.prompt_key)."""
    answer_key: str | None = None
    """Column of the reference answer, dots for nested ones such as `reward_model.ground_truth` (empty:
    task.answer_key; "": the rows have none)."""
    data_source: str = ""
    """The `data_source` a verl reward gets for rows without a `data_source` column (empty: `path`)."""


class RewardConfig(Section):
    """One reward function of a weighted sum (as TRL's `reward_funcs` with `reward_weights`)."""

    fn: str
    """`math` (math-verify), `package.module:function`, `package.module.function` or `path/to/file.py:function`;
    the calling convention (ours, verl's `compute_score`, TRL's batch function) is told from the parameters."""
    weight: float = 1.0
    """Weight of this reward in the sum."""
    name: str = ""
    """Name of the component in `sample.metadata['rewards']` and the `reward/<name>` metric (empty: the
    function's name)."""


class OverlongPenaltyConfig(Section):
    """DAPO's soft overlong punishment: past `max_tokens - buffer_tokens` response tokens the reward falls
    linearly, by `factor` at `max_tokens`."""

    buffer_tokens: int = Field(0, ge=0)
    """Length of the penalty ramp in tokens (0: no overlong penalty)."""
    max_tokens: int = Field(0, ge=0)
    """Length at which the penalty reaches `factor` (0: rollout.max_new_tokens)."""
    factor: float = Field(1.0, ge=0)
    """Penalty at `max_tokens`."""


class LengthPenaltyConfig(Section):
    """A linear length penalty: `coef x max(0, tokens - free_tokens) / (max_tokens - free_tokens)`."""

    coef: float = Field(0.0, ge=0)
    """Penalty of a response of `max_tokens` tokens (0: no length penalty)."""
    free_tokens: int = Field(0, ge=0)
    """Response tokens that cost nothing."""
    max_tokens: int = Field(0, ge=0)
    """Length at which the penalty reaches `coef` (0: rollout.max_new_tokens)."""


class TaskConfig(Section):
    """Prompts and reward."""

    name: Literal["count", "copy", "jsonl", "parquet", "dataset"] = "count"
    """Built-in task (`count`, `copy`), or datasets: `dataset` (from `path` or `datasets`), `jsonl`/`parquet`
    (`path` read in that format)."""
    path: str = ""
    """One dataset (file, folder or Hugging Face name): shorthand for `datasets: [{path: ...}]`."""
    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Training datasets, mixed by their weights (deterministic by `seed`)."""
    eval_datasets: list[DatasetConfig] = Field(default_factory=list)
    """Validation datasets (read in file order, not mixed), for evaluation."""
    reward: str = ""
    """One reward function (see `rewards[].fn`; empty: `rewards`, else the task's own: math for datasets)."""
    rewards: list[RewardConfig] = Field(default_factory=list)
    """Several reward functions whose weighted sum is the reward; each one is also kept per sample."""
    overlong_penalty: OverlongPenaltyConfig = Field(default_factory=OverlongPenaltyConfig)
    """DAPO's overlong penalty, added to the reward."""
    length_penalty: LengthPenaltyConfig = Field(default_factory=LengthPenaltyConfig)
    """A linear length penalty, subtracted from the reward."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Longest one reward call may take, from its start (waiting for a free reward worker does not count, up to ten
    times this long); past it the sample's reward is NaN (a failed reward, counted and logged), and the call's
    process is killed or its thread left to finish (`reward_isolation`)."""
    reward_workers: int = Field(2, ge=1)
    """How many reward calls run at once: the driver's reward threads or processes (`reward_isolation`). Two
    suit a small machine whose cores the engines and trainer use; raise it where rewards are slow (math-verify on
    long answers, a judge behind a blocking client) and cores or remote capacity are free."""
    reward_isolation: Literal["auto", "thread", "process"] = "auto"
    """Where plain reward functions run: "thread" (cheap, but a call past reward_timeout_s keeps running, and one
    that holds the GIL in a long C call stalls the whole driver), "process" (a call past its time is killed with
    its process; arguments and results must pickle), "auto": processes for math-verify's reward (`math` or
    `megatron_rl.rollout.tasks:math_reward`, the datasets' default: sympy can spend minutes in one C call on a
    response such as 9^{9^{9}}), threads otherwise."""
    prompt_key: str = "prompt"
    """Dataset column holding the prompt (text, or chat messages rendered with the chat template)."""
    answer_key: str = "answer"
    """Dataset column holding the reference answer; dots reach nested columns (`reward_model.ground_truth`);
    empty: the rows have none (the reward reads other columns)."""
    chat_template: str = ""
    """Jinja chat template (or a file holding one) for chat-message prompts (empty: the tokenizer's own)."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Dataset prompts longer than this are skipped and counted. In a run it defaults to what fits beside the
    response (model.max_sequence_length - rollout.max_new_tokens); a value set that does not fit is refused."""
    seed: int = 0
    """Seed of prompt generation, dataset shuffling and mixing."""
    shuffle: bool = True
    """Shuffle dataset rows each epoch (off: file order, mixes interleaved by weight)."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the dataset (empty: endless)."""
    length: int = Field(8, ge=1)
    """Target response length of the built-in tasks."""
    max_bad_reward_groups_in_a_row: int = Field(32, ge=1)
    """Groups dropped in a row because a reward raised or was not a finite number before the run stops (a reward
    function that always fails is a bug, not noise); single failures are counted and the run goes on."""

    @model_validator(mode="after")
    def _check_sources(self) -> TaskConfig:
        builtin = self.name in ("count", "copy")
        if builtin and (self.path or self.datasets):
            raise ValueError(
                f"task.name={self.name} is a built-in task: task.path/task.datasets need task.name=dataset"
            )
        if self.path and self.datasets:
            raise ValueError("task.path and task.datasets both set: put every dataset in task.datasets")
        if not builtin and not (self.path or self.datasets):
            raise ValueError(f"task.name={self.name} needs task.path or task.datasets (the prompts)")
        if self.name in ("jsonl", "parquet") and self.datasets:
            raise ValueError(f"task.name={self.name} reads task.path; for task.datasets use task.name=dataset")
        if self.reward and self.rewards:
            raise ValueError("task.reward and task.rewards both set: list every reward in task.rewards")
        return self

    def dataset_specs(self) -> list[DatasetConfig]:
        """The training datasets, with task-level keys filled in (`path` becomes a one-dataset list)."""
        specs = self.datasets or [DatasetConfig(path=self.path, format=_FORMATS.get(self.name, "auto"))]
        return [self._filled(spec) for spec in specs]

    def eval_specs(self) -> list[DatasetConfig]:
        """The validation datasets, with task-level keys filled in."""
        return [self._filled(spec) for spec in self.eval_datasets]

    def _filled(self, spec: DatasetConfig) -> DatasetConfig:
        prompt_key = self.prompt_key if spec.prompt_key is None else spec.prompt_key
        answer_key = self.answer_key if spec.answer_key is None else spec.answer_key
        return spec.model_copy(update={"prompt_key": prompt_key, "answer_key": answer_key})

    def reward_specs(self) -> list[RewardConfig]:
        """The configured rewards (`reward` becomes a one-reward list); empty: the task's own."""
        return list(self.rewards) or ([RewardConfig(fn=self.reward)] if self.reward else [])


_FORMATS = {"jsonl": "jsonl", "parquet": "parquet"}
