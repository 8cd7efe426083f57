"""Tasks: where prompts come from and how responses are rewarded.

A `Task` yields prompt records (JSON-able dicts: `prompt` text, `prompt_ids`, `answer`, `source`) epoch by epoch
and rewards a decoded response against the record's answer. `PromptStream` walks a task's prompts with a data
position that checkpoints save and restore. Built-in tasks are small enough that a tiny random MoE learns them on
CPU in minutes; `DatasetTask` reads jsonl/parquet prompts through `datasets`.

Rewards are pluggable by dotted path (`package.module:function` or `package.module.function`), called as
`fn(response_text, answer, sample) -> float`. `Task.score` never raises: a reward that raises or returns a
non-number, NaN or inf is counted, logged with the sample's prompt index, and scored NaN, which makes the rollout
buffer drop the whole group as 'bad_reward' (a substitute such as 0 would skew the group-relative advantages of
the group's other samples).
"""

from __future__ import annotations

import abc
import collections
import importlib
import math
import numbers
import random
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megatron_rl.errors import UserError

RewardFn = Callable[[str, Any, Any], float]
"""fn(response_text, answer, sample) -> float; `sample` is a `Sample` (or None outside a rollout)."""

FAILURE_LOG_SIZE = 100  # recent reward failures / skipped rows kept in full; the counts are always complete


class TaskError(UserError, ValueError):
    """A task cannot be built or used; the message names the file, row, field or dotted path at fault."""


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers: HF (`transformers`) and raw `tokenizers.Tokenizer` objects both work.


def load_tokenizer(path: str | Path):
    """Load the tokenizer of a HF checkpoint folder (the same one vLLM serves)."""
    from transformers import AutoTokenizer  # seconds to import; the buffer actor uses this module without it

    return AutoTokenizer.from_pretrained(str(path))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, with whatever special tokens the tokenizer itself adds to a prompt."""
    out = tokenizer.encode(text)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def _prompt_text(tokenizer, prompt: Any) -> str | None:
    """Prompt text of a dataset cell: a string, or chat messages rendered with the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
        if not hasattr(tokenizer, "apply_chat_template"):
            return None
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return None


# ----------------------------------------------------------------------------------------------------------------
# Pluggable rewards.


def load_reward(path: str) -> RewardFn:
    """Import a reward function from `package.module:function` or `package.module.function`."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise TaskError(f"reward {path!r}: expected 'package.module:function' or 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise TaskError(f"reward {path!r}: cannot import module {module_name!r}: {err}") from err
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise TaskError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TaskError(f"reward {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


# ----------------------------------------------------------------------------------------------------------------
# Math answers: the last \boxed{...} or else the last number of the response, compared numerically.

# Thousands separators only in groups of three, so that a list "1,2,3" does not read as 123.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def parse_number(text: str) -> float | None:
    """The value of a number written as an integer, decimal, `1,234`, `a/b` or `\\frac{a}{b}`; else None."""
    text = text.strip().strip("$").strip()
    frac = _FRAC.fullmatch(text)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return None if num is None or den in (None, 0) else num / den
    text = text.replace(",", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den) if float(den) != 0 else None
        return float(text)
    except ValueError:
        return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last `\\boxed{...}`, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers_found = _NUMBER.findall(_FRAC.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text))
    return numbers_found[-1] if numbers_found else None


def _reference_value(answer: Any) -> tuple[float | None, str]:
    """Numeric value and normalised text of a reference answer (number, '42', '#### 42', '\\boxed{42}')."""
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        return float(answer), str(answer)
    text = str(answer)
    value = parse_number(text)
    if value is None:
        extracted = extract_answer(text)
        if extracted is not None:
            text, value = extracted, parse_number(extracted)
    return value, _normalise(text)


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text).strip("$.").lower()


def math_reward(response: str, answer: Any, sample: Any = None) -> float:
    """1.0 when the response's final answer (last `\\boxed{}` or last number) equals the reference, else 0.0.

    Numbers compare with relative tolerance 1e-6; non-numeric answers compare as whitespace-free lower-case text.
    """
    got = extract_answer(response)
    if got is None:
        return 0.0
    ref_value, ref_text = _reference_value(answer)
    value = parse_number(got)
    if ref_value is not None and value is not None:
        return 1.0 if math.isclose(value, ref_value, rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return 1.0 if _normalise(got) == ref_text else 0.0


# ----------------------------------------------------------------------------------------------------------------
# The Task interface.


class Task(abc.ABC):
    """Prompts plus a reward. Subclasses implement `prompts` and `reward`; callers use `score`."""

    name: str = "task"
    """Short name (metrics, errors)."""
    chance_level: float | None = None
    """Expected reward of a policy that samples tokens uniformly from the vocabulary (None: unknown)."""

    def __init__(self, reward_fn: RewardFn | None = None, reward_name: str = ""):
        self.reward_fn = reward_fn
        self.reward_name = reward_name or (getattr(reward_fn, "__qualname__", "") if reward_fn else self.name)
        self.reward_failures = 0
        self.reward_failure_log: collections.deque[dict] = collections.deque(maxlen=FAILURE_LOG_SIZE)
        self._failure_lock = threading.Lock()  # rewards are scored on several driver threads

    @abc.abstractmethod
    def prompts(self, epoch: int = 0, start: int = 0) -> Iterator[dict]:
        """Prompt records of one epoch from position `start` on (endless for generated tasks).

        Each record is JSON-able: `prompt` (text), `prompt_ids` (token ids), `answer`, `source`.
        """

    @abc.abstractmethod
    def reward(self, response: str, answer: Any, sample: Any = None) -> float:
        """The task's own reward of a decoded response."""

    def score(self, response: str, answer: Any, sample: Any = None) -> float:
        """The reward (the configured function, else the task's own); NaN, counted and logged, when it fails.

        A failure is a raise, a non-number, NaN or inf. When `sample` is given, its metadata gets
        `reward_error`, which the buffer reports when it drops the group.
        """
        fn = self.reward_fn or self.reward
        try:
            value = fn(response, answer, sample)
            error = None if _is_finite_number(value) else f"returned {value!r}"
        except Exception as err:  # any user reward bug: count it, never crash the generation driver
            error = f"raised {type(err).__name__}: {err}"
        if error is None:
            return float(value)
        self.record_failure(error, sample)
        return float("nan")

    def record_failure(self, error: str, sample: Any) -> None:
        """Count and log one failed reward (`error` says how, e.g. "raised ValueError: ..."); mark `sample`."""
        index = getattr(sample, "prompt_index", None)
        message = f"reward {self.reward_name!r} {error}"
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


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


# ----------------------------------------------------------------------------------------------------------------
# Built-in tasks for the tiny models: dense, verifiable, max 1.0, low at random init.

_WORDS = ("the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by")


def _digit_count(text: str) -> int:
    return sum(1 for c in text if c.isascii() and c.isdigit())


class _GeneratedTask(Task):
    """An endless, deterministic prompt generator: prompt i of an epoch depends only on (seed, epoch, i)."""

    def __init__(self, tokenizer, seed: int = 0, length: int = 8, reward_fn: RewardFn | None = None, reward_name=""):
        super().__init__(reward_fn, reward_name)
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
# Dataset files.


class DatasetTask(Task):
    """Prompts from a jsonl or parquet file (loaded with `datasets`), rewarded by a function (math by default).

    Rows whose prompt or answer is missing/empty/not text, or whose prompt is longer than `max_prompt_tokens`,
    are skipped at construction and counted by reason; `skipped_log` names file and row index (0-based record
    number) of the first `FAILURE_LOG_SIZE`. Each epoch visits the remaining rows once, shuffled by
    (`shuffle_seed`, epoch) unless `shuffle_seed` is None.
    """

    name = "dataset"

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        fmt: str | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_prompt_tokens: int = 256,
        reward_fn: RewardFn | None = None,
        reward_name: str = "",
        shuffle_seed: int | None = 0,
    ):
        super().__init__(reward_fn, reward_name)
        self.path = str(path)
        self.fmt = fmt or _format_of(self.path)
        self.tokenizer = tokenizer
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.max_prompt_tokens = max_prompt_tokens
        self.shuffle_seed = shuffle_seed
        self.skipped: collections.Counter[str] = collections.Counter()
        self.skipped_log: list[dict] = []
        self._rows = _load_rows(self.path, self.fmt)
        self._check_columns()
        self._valid = [i for i in range(len(self._rows)) if self._row_ok(i)]
        if not self._valid:
            raise TaskError(f"{self.path}: no usable rows out of {len(self._rows)} ({self.skip_summary()})")

    def _check_columns(self) -> None:
        columns = set(self._rows.column_names)
        missing = [k for k in (self.prompt_key, self.answer_key) if k not in columns]
        if missing:
            raise TaskError(
                f"{self.path}: no column {', '.join(map(repr, missing))} (columns: {sorted(columns)}); "
                "set task.prompt_key / task.answer_key"
            )

    def _skip(self, row: int, reason: str, detail: str) -> bool:
        self.skipped[reason] += 1
        if len(self.skipped_log) < FAILURE_LOG_SIZE:
            self.skipped_log.append({"file": self.path, "row": row, "reason": reason, "detail": detail})
        return False

    def _row_ok(self, row: int) -> bool:
        record = self._rows[row]
        prompt, answer = record.get(self.prompt_key), record.get(self.answer_key)
        if prompt is None or prompt == "" or prompt == []:
            return self._skip(row, "missing_prompt", f"field {self.prompt_key!r} is missing or empty")
        if answer is None or answer == "":
            return self._skip(row, "missing_answer", f"field {self.answer_key!r} is missing or empty")
        text = _prompt_text(self.tokenizer, prompt)
        if text is None:
            return self._skip(row, "bad_prompt", f"field {self.prompt_key!r} is a {type(prompt).__name__}, not text")
        length = len(encode(self.tokenizer, text))
        if length > self.max_prompt_tokens:
            return self._skip(row, "too_long", f"{length} prompt tokens > max_prompt_tokens={self.max_prompt_tokens}")
        return True

    def __len__(self) -> int:
        return len(self._valid)

    def skip_summary(self) -> str:
        """One line: skipped rows by reason and the first few locations."""
        if not self.skipped:
            return "no rows skipped"
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        where = "; ".join(f"{e['file']} row {e['row']}: {e['detail']}" for e in self.skipped_log[:3])
        return f"skipped {sum(self.skipped.values())} rows ({counts}); e.g. {where}"

    def _order(self, epoch: int) -> list[int]:
        order = list(self._valid)
        if self.shuffle_seed is not None:
            random.Random(f"{self.shuffle_seed}:{epoch}").shuffle(order)
        return order

    def prompts(self, epoch: int = 0, start: int = 0) -> Iterator[dict]:
        """The usable rows of one epoch from position `start` on."""
        for row in self._order(epoch)[start:]:
            record = self._rows[row]
            text = _prompt_text(self.tokenizer, record[self.prompt_key])
            yield {
                "prompt": text,
                "prompt_ids": encode(self.tokenizer, text),
                "answer": record[self.answer_key],
                "source": f"{self.path}:{row}",
            }

    def reward(self, response: str, answer: Any, sample: Any = None) -> float:
        """Math answer reward (`math_reward`) unless a reward function was configured."""
        return math_reward(response, answer, sample)

    def report(self) -> dict:
        """Reward failures plus skipped rows by reason (and where)."""
        out = super().report()
        out.update(rows=len(self._rows), usable=len(self._valid), skipped=dict(self.skipped))
        out["skipped_examples"] = self.skipped_log[:10]
        return out


def _format_of(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "json"
    if suffix == ".parquet":
        return "parquet"
    raise TaskError(f"{path}: cannot tell the format from {suffix!r}; use a .jsonl or .parquet file")


def _load_rows(path: str, fmt: str):
    """The file's rows as a `datasets.Dataset` (no caching next to the user's file)."""
    if not Path(path).is_file():
        raise TaskError(f"dataset file {path!r} does not exist")
    try:
        import datasets  # optional, and slow to import: only for parquet files
    except ImportError as err:
        raise TaskError(f"{path}: reading datasets needs the `datasets` package ({err})") from err
    builder = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(fmt)
    if builder is None:
        raise TaskError(f"{path}: unknown dataset format {fmt!r} (allowed: jsonl, parquet)")
    try:
        return datasets.load_dataset(builder, data_files=path, split="train", keep_in_memory=True)
    except Exception as err:  # datasets raises many types (Arrow, JSON, cast errors)
        raise TaskError(f"{path}: cannot read as {fmt}: {type(err).__name__}: {err}") from err


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
# Factory.


def make_task(cfg, tokenizer, seed: int = 0, length: int = 8) -> Task:
    """Build the task a `TaskConfig` describes; `tokenizer` is a tokenizer object or a checkpoint folder."""
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    reward_fn = load_reward(cfg.reward) if cfg.reward else None
    if cfg.name in BUILTIN_TASKS:
        return BUILTIN_TASKS[cfg.name](tokenizer, seed=seed, length=length, reward_fn=reward_fn, reward_name=cfg.reward)
    if cfg.name in ("jsonl", "parquet"):
        if not cfg.path:
            raise TaskError(f"task.name={cfg.name!r} needs task.path (the dataset file)")
        return DatasetTask(
            cfg.path,
            tokenizer,
            fmt=cfg.name,
            prompt_key=cfg.prompt_key,
            answer_key=cfg.answer_key,
            max_prompt_tokens=cfg.max_prompt_tokens,
            reward_fn=reward_fn,
            reward_name=cfg.reward,
            shuffle_seed=seed,
        )
    allowed = sorted(BUILTIN_TASKS) + ["jsonl", "parquet"]
    raise TaskError(f"task.name={cfg.name!r} is not a task (allowed: {', '.join(allowed)})")
