"""Datasets: reading jsonl/parquet files, folders and Hugging Face datasets (through `datasets`), turning rows
into prompt records, and mixing several datasets by weight.

A prompt record is JSON-able: `prompt` (text), `prompt_ids`, `answer` (the `answer_key` column; dots reach nested
columns), `source` (`file:row`), `data_source` (the row's `data_source` column, else the dataset's), `row` (every
column but the prompt, for the rewards) and, for chat prompts, `messages` (the raw chat messages).

Every error names the file and where in it: `line N (row R), column C` for text that is not UTF-8 or JSON, the
column (and row) for a missing or misspelt key. Rows 0-based, lines and columns 1-based.
"""

from __future__ import annotations

import collections
import datetime
import json
import random
import re
from pathlib import Path
from typing import Any

from megatron_rl.config.task import DatasetConfig
from megatron_rl.rollout.types import TaskError

FAILURE_LOG_SIZE = 100  # skipped rows kept in full; the counts are always complete
FILE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_MISSING = object()


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, with whatever special tokens the tokenizer itself adds to a prompt."""
    out = tokenizer.encode(text)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def one_line(text: Any, limit: int = 300) -> str:
    """The first line of `text`, at most `limit` characters (errors are printed as one line)."""
    lines = str(text).strip().splitlines()
    first = lines[0].strip() if lines else ""
    return first if len(first) <= limit else first[:limit] + "..."


def lookup(row: dict, key: str) -> Any:
    """`row[key]`, where dots in `key` reach into nested columns (a column whose own name has the dots wins);
    `_MISSING` when a part is absent. A numeric part indexes a list (`prompt.0.content`)."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def jsonable(value: Any) -> Any:
    """A JSON-able copy of a dataset cell (records travel through Ray and into checkpoints as JSON)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


# ----------------------------------------------------------------------------------------------------------------
# Reading.


def format_of(spec: DatasetConfig) -> str:
    """`jsonl`, `parquet` or `hf` (a folder or a Hugging Face name) for a dataset spec; TaskError for a path
    that is neither an existing file or folder nor a dataset name."""
    if spec.format != "auto":
        _check_format(spec)
        return spec.format
    path = Path(spec.path)
    suffix = path.suffix.lower()
    if path.is_dir():
        return "hf"
    if path.is_file():
        if suffix in FILE_FORMATS:
            return FILE_FORMATS[suffix]
        raise TaskError(f"{spec.path}: cannot tell the format from {suffix!r}; use a .jsonl or .parquet file")
    if suffix in FILE_FORMATS or not _HUB_NAME.fullmatch(spec.path) or spec.path.startswith("."):
        raise TaskError(f"dataset file {spec.path!r} does not exist")
    return "hf"


def _check_format(spec: DatasetConfig) -> None:
    """TaskError when a local file is not in the format the config forces on it (`task.name` jsonl or parquet, or
    the dataset's `format`): read anyway, a Parquet file failed as text that is not UTF-8."""
    path = Path(spec.path)
    if not path.is_file():
        return
    forced = f"read as {spec.format} (task.name or the dataset's format says so; format auto goes by the suffix)"
    if spec.format == "hf":
        raise TaskError(f"{spec.path}: a file, {forced}, which reads a dataset folder or a Hugging Face name")
    with path.open("rb") as file:
        parquet = file.read(4) == b"PAR1"
    if parquet != (spec.format == "parquet"):
        raise TaskError(f"{spec.path}: {'a Parquet file' if parquet else 'not a Parquet file'}, {forced}")


def read_rows(spec: DatasetConfig):
    """The rows of one dataset as a `datasets.Dataset`, or one clear TaskError."""
    import datasets  # slow to import (Arrow, pandas): only where a dataset is read, not in every Ray actor

    fmt = format_of(spec)
    previous = datasets.logging.get_verbosity()
    # Its warnings, progress bars and its own log line of a failure would fill the console; we say what failed.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        if fmt == "hf":
            return _read_hf(datasets, spec)
        return _read_file(datasets, spec.path, fmt)
    finally:
        datasets.logging.set_verbosity(previous)


def _read_file(datasets, path: str, fmt: str):
    file = Path(path)
    if not file.is_file():
        raise TaskError(f"dataset file {path!r} does not exist")
    if file.stat().st_size == 0:
        raise TaskError(f"{path}: the file is empty (no rows)")
    if fmt == "jsonl":
        check_jsonl_text(path)
    builder = {"jsonl": "json", "parquet": "parquet"}[fmt]
    try:
        rows = datasets.load_dataset(builder, data_files=path, split="train", keep_in_memory=True)
    except Exception as err:  # datasets raises many types (Arrow, JSON, cast errors); name the line if we can
        found = diagnose_jsonl(path) if fmt == "jsonl" else None
        raise TaskError(found or f"{path}: cannot read as {fmt}: {type(err).__name__}: {_cause(err)}") from None
    if len(rows) == 0:
        raise TaskError(f"{path}: no rows")
    return rows


def _cause(err: BaseException) -> str:
    """The innermost message of a chain (datasets wraps the Arrow error that says what is wrong)."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return one_line(err)


def check_jsonl_text(path: str) -> None:
    """Refuse a jsonl file that is not UTF-8 (naming line, row and column) or holds no record at all."""
    records = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                column = len(raw[: err.start].decode("utf-8", errors="replace")) + 1
                raise TaskError(
                    f"{path} line {number} (row {records}), column {column}: not UTF-8 text (byte "
                    f"0x{raw[err.start]:02x}); save the file as UTF-8"
                ) from None
            records += bool(text.strip())
    if records == 0:
        raise TaskError(f"{path}: the file is empty (no rows)")


def diagnose_jsonl(path: str) -> str | None:
    """Where a jsonl file goes wrong: the first line that is not a JSON object, or whose field has another JSON
    type than in earlier lines (Arrow needs one type per column); None when no such line is found."""
    types: dict[str, tuple[str, int]] = {}
    row = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number} (row {row})"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                return f"{where}, column {err.colno}: not valid JSON: {err.msg}"
            if not isinstance(value, dict):
                return f"{where}, column 1: expected a JSON object, got {type(value).__name__}"
            for key, cell in value.items():
                kind = _json_kind(cell)
                seen = types.setdefault(key, (kind, number))
                if kind != "null" and seen[0] == "null":
                    types[key] = (kind, number)
                elif "null" not in (kind, seen[0]) and kind != seen[0]:
                    return f"{where}, column {key!r}: a {kind} here but a {seen[0]} in line {seen[1]}"
            row += 1
    return None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}[type(value)]


def _read_hf(datasets, spec: DatasetConfig):
    """A folder (`save_to_disk`'s, or one of data files) or a Hugging Face dataset name: `load_dataset` reads a
    name from the Hub, or from the local cache when the Hub cannot be reached (at once with HF_DATASETS_OFFLINE=1)."""
    where = f"dataset {spec.path!r}" + (f" (subset {spec.subset!r})" if spec.subset else "")
    folder = Path(spec.path)
    try:
        if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
            rows = datasets.load_from_disk(str(folder), keep_in_memory=True)
            if isinstance(rows, datasets.DatasetDict):
                if spec.split not in rows:
                    raise TaskError(f"{where}: no split {spec.split!r} (splits: {sorted(rows)})")
                rows = rows[spec.split]
        else:
            rows = datasets.load_dataset(spec.path, name=spec.subset or None, split=spec.split)
    except TaskError:
        raise
    except ConnectionError as err:
        raise TaskError(
            f"{where}: the Hugging Face Hub cannot be reached and the dataset is not in the local cache "
            f"({datasets.config.HF_DATASETS_CACHE}): {one_line(err)}; download it where there is network (the cache "
            "is then used offline, HF_DATASETS_OFFLINE=1 skips the Hub) or use a local file"
        ) from None
    except Exception as err:  # not found, gated, unknown split or subset...: datasets says which
        raise TaskError(f"{where}: cannot load it: {_folder_problem(folder) or _error_and_cause(err)}") from None
    if len(rows) == 0:
        raise TaskError(f"{where}: no rows in split {spec.split!r}")
    return rows


def _folder_problem(folder: Path) -> str | None:
    """Where the first broken jsonl file of a local folder of data files goes wrong (datasets says only "An error
    occurred while generating the dataset"), else None."""
    if not folder.is_dir():
        return None
    for path in sorted(folder.rglob("*.jsonl")):
        try:
            check_jsonl_text(str(path))
            problem = diagnose_jsonl(str(path))
        except TaskError as err:
            return str(err)
        if problem:
            return problem
    return None


def _error_and_cause(err: BaseException) -> str:
    cause = _cause(err)
    head = f"{type(err).__name__}: {one_line(err)}"
    return head if cause == one_line(err) else f"{head} ({cause})"


# ----------------------------------------------------------------------------------------------------------------
# Prompts.


def chat_template_text(value: str) -> str:
    """`task.chat_template`: the template itself (it holds `{{` or `{%`) or a file holding one."""
    if not value or "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise TaskError(f"task.chat_template={value!r}: neither a Jinja template nor an existing file")
    return path.read_text(encoding="utf-8")


def render_chat(tokenizer, messages: list[dict], template: str) -> str:
    """Chat messages as prompt text: with `template` when given, else with the tokenizer's own chat template."""
    if template and not hasattr(tokenizer, "apply_chat_template"):  # a raw `tokenizers.Tokenizer`
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # only for raw tokenizers (tests), as HF renders

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=True)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template or None
    )


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template of its own."""
    return bool(getattr(tokenizer, "chat_template", None))


def is_chat(prompt: Any) -> bool:
    """Whether a prompt cell is chat messages (a non-empty list of dicts with `content`)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "content" in m for m in prompt)


class DatasetSource:
    """One dataset's rows, checked: a missing column is an error; rows whose prompt or answer is missing or empty
    or whose prompt is longer than `max_prompt_tokens` are skipped and counted by reason (`skipped_log` names
    file and row of the first `FAILURE_LOG_SIZE`)."""

    def __init__(self, spec: DatasetConfig, tokenizer, max_prompt_tokens: int, chat_template: str = ""):
        # A spec outside a TaskConfig has no keys filled in: the task's defaults.
        answer_key = "answer" if spec.answer_key is None else spec.answer_key
        self.spec = spec.model_copy(update={"prompt_key": spec.prompt_key or "prompt", "answer_key": answer_key})
        self.path = spec.path
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.chat_template = chat_template
        self.skipped: collections.Counter[str] = collections.Counter()
        self.skipped_log: list[dict] = []
        self.rows = read_rows(spec)
        self._check_keys()
        self.valid = self._usable_rows()
        if not self.valid:
            raise TaskError(f"{self.path}: no usable rows out of {len(self.rows)} ({self.skip_summary()})")

    def _check_keys(self) -> None:
        """Every key's first part must be a column; a dotted key must be found in at least one row."""
        columns = list(self.rows.column_names)
        for field, key in (("prompt_key", self.spec.prompt_key), ("answer_key", self.spec.answer_key)):
            if not key or key in columns:
                continue
            top = key.split(".", 1)[0]
            if top not in columns:
                raise TaskError(
                    f"{self.path}: no column {key!r} (columns: {', '.join(columns)}); set task.{field} "
                    "(dots reach nested columns, as in reward_model.ground_truth)"
                )
            cells = self.rows[top]
            if not any(lookup({top: cell}, key) is not _MISSING for cell in cells):
                first = cells[0]
                has = f"keys: {', '.join(map(str, first))}" if isinstance(first, dict) else type(first).__name__
                raise TaskError(
                    f"{self.path} row 0, column {top!r}: no {key!r} in any row (row 0's {top!r} holds {has}); "
                    f"set task.{field}"
                )

    def _skip(self, row: int, reason: str, detail: str) -> bool:
        self.skipped[reason] += 1
        if len(self.skipped_log) < FAILURE_LOG_SIZE:
            self.skipped_log.append({"file": self.path, "row": row, "reason": reason, "detail": detail})
        return False

    def _usable_rows(self) -> list[int]:
        valid = []
        row = 0
        try:
            for row, record in enumerate(self.rows):
                if self._row_ok(row, record):
                    valid.append(row)
        except UnicodeDecodeError as err:  # Arrow keeps invalid UTF-8 of a jsonl and fails when a row is read
            raise TaskError(f"{self.path} row {row}: not UTF-8 text ({err.reason}); save the file as UTF-8") from None
        return valid

    def _row_ok(self, row: int, record: dict) -> bool:
        prompt_key, answer_key = self.spec.prompt_key, self.spec.answer_key
        prompt = lookup(record, prompt_key)
        if prompt is _MISSING or prompt is None or prompt == "" or prompt == []:
            return self._skip(row, "missing_prompt", f"field {prompt_key!r} is missing or empty")
        if answer_key:
            answer = lookup(record, answer_key)
            if answer is _MISSING or answer is None or answer == "":
                return self._skip(row, "missing_answer", f"field {answer_key!r} is missing or empty")
        text = self.prompt_text(row, prompt)
        if text is None:
            return self._skip(row, "bad_prompt", f"field {prompt_key!r} is a {type(prompt).__name__}, not text")
        length = len(encode(self.tokenizer, text))
        if length > self.max_prompt_tokens:
            return self._skip(row, "too_long", f"{length} prompt tokens > max_prompt_tokens={self.max_prompt_tokens}")
        return True

    def prompt_text(self, row: int, prompt: Any) -> str | None:
        """Prompt text of a cell: a string, or chat messages rendered with the chat template (None: neither)."""
        if isinstance(prompt, str):
            return prompt
        if not is_chat(prompt):
            return None
        if not self.chat_template and not has_chat_template(self.tokenizer):
            raise TaskError(
                f"{self.path} row {row}, column {self.spec.prompt_key!r}: the prompt is chat messages but the "
                "tokenizer has no chat template; set task.chat_template (a Jinja template or a file holding one)"
            )
        try:
            return render_chat(self.tokenizer, prompt, self.chat_template)
        except Exception as err:  # a template error (jinja2 raises several types): name the row it failed on
            raise TaskError(
                f"{self.path} row {row}, column {self.spec.prompt_key!r}: the chat template fails: "
                f"{type(err).__name__}: {one_line(err)}"
            ) from None

    def __len__(self) -> int:
        return len(self.valid)

    def record(self, row: int) -> dict:
        """The prompt record of row `row` (see the module docstring)."""
        data = self.rows[row]
        prompt = lookup(data, self.spec.prompt_key)
        text = self.prompt_text(row, prompt)
        answer = lookup(data, self.spec.answer_key) if self.spec.answer_key else None
        others = {k: jsonable(v) for k, v in data.items() if k != self.spec.prompt_key}
        record = {
            "prompt": text,
            "prompt_ids": encode(self.tokenizer, text),
            "answer": jsonable(answer),
            "source": f"{self.path}:{row}",
            "data_source": str(data.get("data_source") or self.spec.data_source or self.path),
            "row": others,
        }
        if is_chat(prompt):
            record["messages"] = jsonable(prompt)
        return record

    def skip_summary(self) -> str:
        """One line: skipped rows by reason and the first few locations."""
        if not self.skipped:
            return "no rows skipped"
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        where = "; ".join(f"{e['file']} row {e['row']}: {e['detail']}" for e in self.skipped_log[:3])
        return f"skipped {sum(self.skipped.values())} rows ({counts}); e.g. {where}"


# ----------------------------------------------------------------------------------------------------------------
# Mixing.


def mix_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Rows of each dataset in one epoch of `sum(sizes)` prompts, in proportion to `weights` (largest remainder,
    so the counts add up exactly)."""
    total, weight = sum(sizes), sum(weights)
    shares = [total * w / weight for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class Mixture:
    """The epoch orders of one or more datasets: each epoch gives dataset i `counts[i]` slots (`mix_counts`),
    filled from its own endless sequence of reshuffled passes, so epoch e continues where epoch e - 1 stopped.

    Everything follows from (seed, epoch): the order of any epoch is computed again identically, which is what
    lets a checkpoint's data position (epoch, offset) resume at exactly the same prompt.
    """

    def __init__(self, sizes: list[int], weights: list[float], seed: int | None, shuffle: bool = True):
        self.sizes, self.seed, self.shuffle = list(sizes), seed, shuffle and seed is not None
        self.counts = mix_counts(self.sizes, weights) if len(sizes) > 1 else list(sizes)
        self._cached: tuple[int, list[tuple[int, int]]] | None = None

    def _pass(self, source: int, number: int) -> list[int]:
        """Row order (indices into the dataset's usable rows) of the dataset's pass `number`."""
        order = list(range(self.sizes[source]))
        if self.shuffle:
            # One dataset keeps the key it always had, so its order (and old checkpoints' positions) stay the same.
            key = f"{self.seed}:{number}" if len(self.sizes) == 1 else f"{self.seed}:{source}:{number}"
            random.Random(key).shuffle(order)
        return order

    def order(self, epoch: int) -> list[tuple[int, int]]:
        """(dataset, usable-row index) of every prompt of `epoch`."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        slots: list[tuple[float, int, int]] = []
        for source, count in enumerate(self.counts):
            size, start = self.sizes[source], epoch * count
            passes: dict[int, list[int]] = {}
            for j in range(count):
                number, at = divmod(start + j, size)
                rows = passes.get(number) or passes.setdefault(number, self._pass(source, number))
                slots.append(((j + 0.5) / count, source, rows[at]))  # spread each dataset evenly over the epoch
        slots.sort()
        order = [(source, row) for _, source, row in slots]
        if self.shuffle and len(self.sizes) > 1:
            random.Random(f"{self.seed}:mix:{epoch}").shuffle(order)
        self._cached = (epoch, order)
        return order
