"""Tasks: where prompts come from and how responses are rewarded.

A `Task` yields prompt records (JSON-able dicts: `prompt` text, `prompt_ids`, `answer`, `source`; dataset rows
add `data_source`, `row` and `messages`, see `rollout/data.py`) epoch by epoch, and scores a group of decoded
responses with its rewards (`rollout/rewards/`). `PromptStream` walks a task's prompts with a data position that
checkpoints save and restore. Built-in tasks are small enough that a tiny random MoE learns them on CPU in
minutes; `DatasetTask` reads jsonl/parquet files, folders and Hugging Face datasets, several mixed by weight.

Rewards are the task's own, or the configured functions (`task.reward`, `task.rewards`: ours, verl's or TRL's
calling convention), with the length penalties added. Scoring never raises: a reward that raises (`sys.exit`
too), times out, or returns a non-number, NaN or inf is counted, logged with the sample's prompt index and
source, and scored NaN, which makes the rollout buffer drop the whole group as 'bad_reward' (a substitute such as
0 would skew the group-relative advantages of the group's other samples).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megatron_rl.config.task import DatasetConfig, TaskConfig
from megatron_rl.models.base import CheckpointError
from megatron_rl.rollout.data import DatasetSource, Mixture, chat_template_text, encode
from megatron_rl.rollout.rewards import (
    InlineRunner,
    RewardFunction,
    RewardSet,
    configured_functions,
    describe,
    load_reward,
    math_reward,
    shapers,
)
from megatron_rl.rollout.types import TaskError

__all__ = [
    "BUILTIN_TASKS", "CopyTask", "CountTask", "DatasetTask", "PromptStream", "Task", "TaskError", "encode",
    "load_reward", "load_tokenizer", "make_eval_prompts", "make_task", "math_reward",
]  # fmt: skip

FAILURE_LOG_SIZE = 100  # recent reward failures kept in full; the counts are always complete


def load_tokenizer(path: str | Path):
    """Load the tokenizer of a HF checkpoint folder (the same one vLLM serves); CheckpointError naming the folder
    when it cannot be loaded, or when what loads holds no vocabulary (a folder without its tokenizer files gets
    a tokenizer of one token from transformers, which encodes every prompt as nothing)."""
    from transformers import AutoTokenizer  # seconds to import; the buffer actor uses this module without it

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # transformers' and tokenizers' own messages do not name the folder
        why = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(f"{path}: cannot load its tokenizer: {type(err).__name__}: {why}") from None
    if len(tokenizer) < 2:
        raise CheckpointError(
            f"{path}: its tokenizer holds {len(tokenizer)} token(s): are tokenizer.json / tokenizer_config.json "
            "(or the vocabulary files they name) missing?"
        )
    return tokenizer


# ----------------------------------------------------------------------------------------------------------------
# The Task interface.


class Task(abc.ABC):
    """Prompts plus rewards. Subclasses implement `prompts` and `reward`; callers use `score_group` (or `score`)."""

    name: str = "task"
    """Short name (metrics, errors)."""
    chance_level: float | None = None
    """Expected reward of a policy that samples tokens uniformly from the vocabulary (None: unknown)."""

    def __init__(self, rewards: list[RewardFunction] | None = None):
        self.reward_functions = list(rewards or [])
        self.shapers: list[Callable[[int], float]] = []
        self.shaping: TaskConfig | None = None
        self.reward_failures = 0
        self.reward_failure_log: collections.deque[dict] = collections.deque(maxlen=FAILURE_LOG_SIZE)
        self._failure_lock = threading.Lock()  # rewards are scored on several driver threads

    @abc.abstractmethod
    def prompts(self, epoch: int = 0, start: int = 0) -> Iterator[dict]:
        """Prompt records of one epoch from position `start` on (endless for generated tasks)."""

    @abc.abstractmethod
    def reward(self, response: str, answer: Any, sample: Any = None) -> float:
        """The task's own reward of a decoded response."""

    @property
    def reward_name(self) -> str:
        """The rewards, as the config named them (logs)."""
        return ", ".join(f.source for f in self.reward_functions) or self.name

    def reward_set(self) -> RewardSet:
        """The configured reward functions (else the task's own) with the length penalties."""
        functions = self.reward_functions or [self.own_reward()]
        return RewardSet(functions, self.shapers)

    def own_reward(self) -> RewardFunction:
        """The task's own reward (`reward`), used where no reward functions were configured."""
        return describe(self.reward, self.name)

    def set_response_limit(self, max_new_tokens: int) -> None:
        """Build the length penalties, whose `max_tokens` of 0 means the engines' `max_new_tokens`."""
        if self.shaping is not None:
            self.shapers = shapers(self.shaping, max_new_tokens)

    async def score_group(
        self, responses: list[str], record: dict, samples: list[Any] | None = None, runner=None
    ) -> list[float]:
        """The rewards of one prompt's responses (NaN where a reward failed: counted, logged, and the sample's
        metadata says why). Each sample's `metadata['rewards']` gets every component's value.

        `samples`: the responses' `Sample`s (None: none, as in evaluation). `runner` runs the calls
        (`rewards.RewardRunner`: threads and a time limit); default: in this thread, without a limit.
        """
        samples = list(samples) if samples is not None else [None] * len(responses)
        scored = await self.reward_set().score(responses, [record] * len(responses), samples, runner or InlineRunner())
        for result, sample in zip(scored, samples):
            metadata = getattr(sample, "metadata", None)
            if isinstance(metadata, dict):
                metadata["rewards"] = result.components
                if result.info:
                    metadata["reward_info"] = result.info
            if result.error is not None:
                self.record_failure(result.error, sample)
        return [result.reward for result in scored]

    def score(self, response: str, answer: Any, sample: Any = None, record: dict | None = None) -> float:
        """The reward of one response in this thread (no time limit; not from inside a running event loop)."""
        record = {**(record or {}), "answer": answer}
        return asyncio.run(self.score_group([response], record, [sample]))[0]

    def record_failure(self, message: str, sample: Any) -> None:
        """Count and log one failed reward (`message` names the reward and says how); mark `sample`."""
        index = getattr(sample, "prompt_index", None)
        with self._failure_lock:
            self.reward_failures += 1
            self.reward_failure_log.append({"prompt_index": index, "error": message})
        if sample is not None and hasattr(sample, "metadata"):
            sample.metadata["reward_error"] = message

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_failure_lock", None)  # a lock does not pickle (tasks may travel to Ray workers)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._failure_lock = threading.Lock()

    def report(self) -> dict:
        """Counts for logs: reward failures and their most recent entries."""
        return {"task": self.name, "reward_failures": self.reward_failures, "recent": list(self.reward_failure_log)}


# ----------------------------------------------------------------------------------------------------------------
# Built-in tasks for the tiny models: dense, verifiable, max 1.0, low at random init.

_WORDS = ("the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by")


def _digit_count(text: str) -> int:
    return sum(1 for c in text if c.isascii() and c.isdigit())


class _GeneratedTask(Task):
    """An endless, deterministic prompt generator: prompt i of an epoch depends only on (seed, epoch, i)."""

    def __init__(self, tokenizer, seed: int = 0, length: int = 8, rewards: list[RewardFunction] | None = None):
        super().__init__(rewards)
        if length < 1:
            raise TaskError(f"task {self.name}: length must be at least 1, got {length}")
        self.tokenizer = tokenizer
        self.seed = seed
        self.length = length

    def prompts(self, epoch: int = 0, start: int = 0) -> Iterator[dict]:
        """Endless prompt records; random access, so `start` costs nothing."""
        index = start
        while True:
            rng = random.Random(f"{self.name}:{self.seed}:{epoch}:{index}")
            text, answer = self._make(rng)
            yield {
                "prompt": text,
                "prompt_ids": encode(self.tokenizer, text),
                "answer": answer,
                "source": f"{self.name}:{epoch}:{index}",
            }
            index += 1

    @abc.abstractmethod
    def _make(self, rng: random.Random) -> tuple[str, Any]:
        """(prompt text, answer) of one prompt."""


class CountTask(_GeneratedTask):
    """'count': write digits. Prompt `count: <3 random words> =`; answer: the target length L (8).

    Reward = min(number of ASCII digit characters in the response, L) / L. A perfect response is L digits (for
    example `00000000`) and scores 1.0. Chance: with the shipped 512-token BPE, 29 of the 512 tokens carry an
    ASCII digit (`0`-`9`, ` 1`-` 9`, and ` 10`-` 14` with two each), so a uniformly random token adds 29/512
    digits on average and a uniformly random policy scores about 0.057. The prompt does not matter: this is the
    quickest signal (the reward's gradient only has to raise digit logits). Measured with a 2-layer, hidden-128
    torch stand-in (not the real MoE), GRPO with 8 prompts x 4 samples and Adam at 1e-3: 0.05 -> 0.9 in 6 steps.
    """

    name = "count"
    chance_level = 29 / 512

    def _make(self, rng: random.Random) -> tuple[str, Any]:
        words = " ".join(rng.choice(_WORDS) for _ in range(3))
        return f"count: {words} =", self.length

    def reward(self, response: str, answer: Any, sample: Any = None) -> float:
        """Fraction of the `answer` (L) digit slots filled with ASCII digits, capped at 1."""
        target = int(answer)
        return min(_digit_count(response), target) / target


class CopyTask(_GeneratedTask):
    """'copy': repeat the digit of the prompt. Prompt `repeat d:` (d in 0-9); answer: d.

    Reward = min(hits + 0.2 x other digits, L) / L with hits the count of the character d in the response, other
    digits the count of every other ASCII digit, and L = 8. A perfect response is d repeated L times (1.0). A
    uniformly random policy scores about 0.016; the best policy that ignores the prompt (always one fixed digit)
    scores 0.1 + 0.9 x 0.2 = 0.28, so a reward above 0.3 means the policy reads the prompt. The partial credit
    makes the first step (emit digits at all) as quick as 'count'. Harder than 'count': the same stand-in as there
    passed 0.28 within 10 steps but hovered at 0.3-0.55 after 300, so it is a check, not the quickstart task.
    """

    name = "copy"
    chance_level = 0.016
    partial_credit = 0.2
    """Credit of a digit that is not the prompt's."""

    def _make(self, rng: random.Random) -> tuple[str, Any]:
        digit = str(rng.randrange(10))
        return f"repeat {digit}:", digit

    def reward(self, response: str, answer: Any, sample: Any = None) -> float:
        """Hits of the prompt's digit plus partial credit for other digits, over L slots, capped at 1."""
        target = str(answer)
        hits = response.count(target)
        others = _digit_count(response) - hits
        return min(hits + self.partial_credit * others, self.length) / self.length


BUILTIN_TASKS: dict[str, type[_GeneratedTask]] = {"count": CountTask, "copy": CopyTask}


# ----------------------------------------------------------------------------------------------------------------
# Datasets.


class DatasetTask(Task):
    """Prompts from one or more datasets (`rollout/data.py`), mixed by weight, rewarded by the configured functions
    (math by default).

    Unusable rows are skipped at construction and counted by reason (`skipped`, `skipped_log`: file and row).
    Each epoch holds as many prompts as all datasets have usable rows, shared out by weight; with one dataset it
    visits every usable row once, shuffled by (`seed`, epoch) unless `shuffle` is off or `seed` is None.
    """

    name = "dataset"

    def __init__(
        self,
        specs: list[DatasetConfig],
        tokenizer,
        max_prompt_tokens: int = 256,
        seed: int | None = 0,
        shuffle: bool = True,
        chat_template: str = "",
        rewards: list[RewardFunction] | None = None,
    ):
        super().__init__(rewards)
        if not specs:
            raise TaskError("a dataset task needs at least one dataset (task.path or task.datasets)")
        self.tokenizer = tokenizer
        self.sources = [DatasetSource(s, tokenizer, max_prompt_tokens, chat_template) for s in specs]
        self.mixture = Mixture([len(s) for s in self.sources], [s.weight for s in specs], seed, shuffle)
        unused = [i for i, count in enumerate(self.mixture.counts) if count == 0]
        if unused:
            i = unused[0]
            raise TaskError(
                f"task.datasets[{i}] ({specs[i].path}): its weight {specs[i].weight:g} gives it no prompt of an epoch"
                f" of {sum(self.mixture.counts)}: raise its weight, or leave it out"
            )

    @property
    def skipped(self) -> collections.Counter[str]:
        """Skipped rows by reason, over all datasets."""
        return sum((s.skipped for s in self.sources), collections.Counter())

    @property
    def skipped_log(self) -> list[dict]:
        """The first skipped rows of every dataset (file, row, reason, detail)."""
        return [entry for s in self.sources for entry in s.skipped_log]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def skip_summary(self) -> str:
        """One line per dataset with skipped rows: by reason, and the first few locations."""
        return "; ".join(s.skip_summary() for s in self.sources if s.skipped) or "no rows skipped"

    def prompts(self, epoch: int = 0, start: int = 0) -> Iterator[dict]:
        """The prompts of one epoch from position `start` on."""
        for source, at in self.mixture.order(epoch)[start:]:
            dataset = self.sources[source]
            yield dataset.record(dataset.valid[at])

    def reward(self, response: str, answer: Any, sample: Any = None) -> float:
        """Math answer reward (math-verify) unless reward functions were configured."""
        return math_reward(response, answer, sample)

    def own_reward(self) -> RewardFunction:
        """The built-in `math` reward itself (not this method: a process would be sent the whole task)."""
        return describe(math_reward, self.name, source="math")

    def report(self) -> dict:
        """Reward failures plus, per dataset, rows, usable rows and skipped rows by reason (and where)."""
        out = super().report()
        out["datasets"] = [
            {"path": s.path, "rows": len(s.rows), "usable": len(s), "skipped": dict(s.skipped)} for s in self.sources
        ]
        out["skipped_examples"] = self.skipped_log[:10]
        return out


# ----------------------------------------------------------------------------------------------------------------
# The data position.


class PromptStream:
    """Walks a task's prompts epoch after epoch, numbering them; the position survives checkpoints.

    `position` is the index the next prompt gets (the buffer's prompt index); an epoch that yields nothing, or
    the end of `epochs`, exhausts the stream.
    """

    def __init__(self, task: Task, epochs: int | None = None):
        self.task = task
        self.epochs = epochs
        self.position = 0
        self.epoch = 0
        self.offset = 0
        self.exhausted = False
        self._it: Iterator[dict] | None = None

    def next(self) -> tuple[int, dict] | None:
        """(prompt index, prompt record), or None when exhausted."""
        while not self.exhausted:
            if self._it is None:
                self._it = self.task.prompts(self.epoch, self.offset)
            record = next(self._it, None)
            if record is not None:
                index = self.position
                self.position += 1
                self.offset += 1
                return index, record
            self._end_epoch()
        return None

    def _end_epoch(self) -> None:
        empty = self.offset == 0
        self.epoch += 1
        self.offset = 0
        self._it = None
        if empty or (self.epochs is not None and self.epoch >= self.epochs):
            self.exhausted = True

    def __getstate__(self) -> dict:
        # A live generator does not pickle (Ray ships the stream to the buffer actor); it restarts from offset.
        return {**self.__dict__, "_it": None}

    def state_dict(self) -> dict:
        """JSON-able data position."""
        return {"position": self.position, "epoch": self.epoch, "offset": self.offset, "exhausted": self.exhausted}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (the task must yield the same prompts, e.g. same file and seed)."""
        self.position = int(state["position"])
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.exhausted = bool(state.get("exhausted", False))
        self._it = None


# ----------------------------------------------------------------------------------------------------------------
# Factories.


def make_task(cfg: TaskConfig, tokenizer, seed: int = 0, length: int = 8) -> Task:
    """Build the task a `TaskConfig` describes; `tokenizer` is a tokenizer object or a checkpoint folder."""
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    functions = configured_functions(cfg)
    if cfg.name in BUILTIN_TASKS:
        task: Task = BUILTIN_TASKS[cfg.name](tokenizer, seed=seed, length=length, rewards=functions)
    elif cfg.name in ("jsonl", "parquet", "dataset"):
        template = chat_template_text(cfg.chat_template)
        task = DatasetTask(
            cfg.dataset_specs(), tokenizer, cfg.max_prompt_tokens, seed, cfg.shuffle, template, rewards=functions
        )
    else:
        allowed = sorted(BUILTIN_TASKS) + ["dataset", "jsonl", "parquet"]
        raise TaskError(f"task.name={cfg.name!r} is not a task (allowed: {', '.join(allowed)})")
    task.shaping = cfg
    shapers(cfg, max_new_tokens=1 << 30)  # refuse a bad penalty config now; built for real by set_response_limit
    return task


def make_eval_prompts(cfg: TaskConfig, tokenizer, limit: int | None = None) -> list[dict]:
    """The prompt records of `task.eval_datasets` (each dataset's usable rows in file order, at most `limit` of
    each), in the format of the training records: score them with the training task's `score_group`.

    Bad data fails here as it does for training (TaskError naming file, row and column); [] without eval data.
    """
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    template = chat_template_text(cfg.chat_template)
    records = []
    for spec in cfg.eval_specs():
        source = DatasetSource(spec, tokenizer, cfg.max_prompt_tokens, template)
        records += [source.record(row) for row in source.valid[:limit]]
    return records
