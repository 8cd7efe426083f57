"""Reward functions by name, and the three calling conventions, told apart by their parameters.

- ours: `fn(response, answer, sample)` per response (`sample` the `Sample`); a parameter `row` (or `**kwargs`)
  also gets the dataset row. Batched: `fn(responses, answers, samples)` once per group.
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None)` per response, returning a float or
  a dict with "score"; batched: `compute_score(data_sources, solution_strs, ground_truths, extra_infos)`.
- TRL: `f(prompts, completions, **kwargs) -> list[float | None]` once per group, with `completion_ids` and every
  other dataset column as a list in the keyword arguments (as TRL's GRPOTrainer passes them); None means "does
  not apply to this sample".

Any of them may be `async def`. A call returns one value per response; `outcome` turns a value into a number or
says why it is not one.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rl.rollout.rewards.math import basic_math_reward, math_reward
from megatron_rl.rollout.types import TaskError

BUILTIN_REWARDS: dict[str, Callable] = {"math": math_reward, "math_basic": basic_math_reward}
"""Rewards by short name: `math` (math-verify; the basic parser where it is absent), `math_basic`."""
CONVENTIONS = ("ours", "ours_batch", "verl", "verl_batch", "trl")
FILE_MODULE_PREFIX = "megatron_rl_reward_file_"
"""Module names given to reward files (`path/to/file.py:function`)."""
_VERL = ("data_source", "solution_str", "ground_truth")
_VERL_BATCH = ("data_sources", "solution_strs", "ground_truths")


@dataclasses.dataclass
class RewardFunction:
    """A reward function, how to call it, and its place in the weighted sum."""

    fn: Callable
    """The function (or callable object)."""
    name: str
    """Component name (`sample.metadata['rewards']`, `reward/<name>`)."""
    weight: float = 1.0
    """Weight in the sum."""
    convention: str = "ours"
    """One of `CONVENTIONS`."""
    is_async: bool = False
    """Whether calling it returns an awaitable (`async def`)."""
    wants_row: bool = False
    """(ours) whether it takes the dataset row (`row=` or `**kwargs`)."""
    wants_extra_info: bool = True
    """(verl) whether it takes `extra_info`."""
    source: str = ""
    """What the config named (`task.reward`, `task.rewards[].fn`), for messages and to load it again."""

    def __post_init__(self) -> None:
        self.source = self.source or self.name

    def target(self) -> Callable:
        """The function (loaded again from `source` after travelling to another process, when from a file)."""
        if self.fn is None:
            self.fn = load_reward(self.source)
        return self.fn

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if getattr(state["fn"], "__module__", "").startswith(FILE_MODULE_PREFIX):
            state["fn"] = None  # its module is not importable elsewhere: load the file again there, on first use
        return state

    @property
    def batched(self) -> bool:
        """Whether it is called once per group (else once per response)."""
        return self.convention in ("ours_batch", "verl_batch", "trl")

    def arguments(self, responses: list[str], records: list[dict], samples: list[Any]) -> list[tuple[tuple, dict]]:
        """The (args, kwargs) of each call: one per response, or one for the whole group when batched."""
        kind = self.convention
        if kind == "trl":
            return [((), trl_kwargs(responses, records, samples))]
        if kind == "verl_batch":
            kwargs = {
                "data_sources": [r.get("data_source") for r in records],
                "solution_strs": list(responses),
                "ground_truths": [r.get("answer") for r in records],
            }
            if self.wants_extra_info:
                kwargs["extra_infos"] = [extra_info(r) for r in records]
            return [((), kwargs)]
        if kind == "ours_batch":
            return [((list(responses), [r.get("answer") for r in records], list(samples)), {})]
        calls = []
        for response, record, sample in zip(responses, records, samples):
            if kind == "verl":
                kwargs = {"data_source": record.get("data_source"), "solution_str": response}
                kwargs["ground_truth"] = record.get("answer")
                if self.wants_extra_info:
                    kwargs["extra_info"] = extra_info(record)
                calls.append(((), kwargs))
            else:
                row = {"row": record.get("row", {})} if self.wants_row else {}
                calls.append(((response, record.get("answer"), sample), row))
        return calls


def extra_info(record: dict) -> Any:
    """verl's `extra_info`: the row's `extra_info` column ({} without one)."""
    return record.get("row", {}).get("extra_info", {})


def trl_kwargs(responses: list[str], records: list[dict], samples: list[Any]) -> dict:
    """TRL's arguments: `prompts` (the raw prompts: text or chat messages), `completions` (text, or one assistant
    message each for chat prompts), `completion_ids`, and every other column as a list."""
    chat = [isinstance(r.get("messages"), list) for r in records]
    kwargs: dict[str, Any] = {
        "prompts": [r["messages"] if is_chat else r.get("prompt") for r, is_chat in zip(records, chat)],
        "completions": [
            [{"role": "assistant", "content": text}] if is_chat else text for text, is_chat in zip(responses, chat)
        ],
        "completion_ids": [list(getattr(s, "response_ids", []) or []) for s in samples],
    }
    columns = [key for key in records[0].get("row", {}) if key not in ("prompt", "completion", "completion_ids")]
    for key in columns:
        kwargs[key] = [r.get("row", {}).get(key) for r in records]
    versions = [v for s in samples if callable(getattr(s, "max_version", None)) and (v := s.max_version()) is not None]
    kwargs["trainer_state"] = types.SimpleNamespace(global_step=max(versions, default=0))  # the policy's version
    return kwargs


def outcome(value: Any) -> tuple[float | None, dict, str | None]:
    """(number or None for "does not apply", extra entries of a verl dict, error) of one returned value."""
    extras: dict = {}
    if isinstance(value, dict):
        if "score" not in value:
            return None, {}, f"returned a dict without 'score' (keys: {sorted(map(str, value))})"
        extras = {str(k): v for k, v in value.items() if k != "score" and _is_plain(v)}
        value = value["score"]
    if value is None:
        return None, extras, None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        count = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)  # torch, numpy
        if count != 1:
            return None, extras, f"returned an array of shape {tuple(getattr(value, 'shape', ()))}, not one number"
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value), extras, None
    return None, extras, f"returned {value!r}"


def _is_plain(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


# ----------------------------------------------------------------------------------------------------------------
# Loading.


def load_reward(path: str) -> Callable:
    """A reward function from a built-in name (`math`), `package.module:function`, `package.module.function` or
    `path/to/file.py:function`."""
    if path in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[path]
    if path.endswith(".py"):  # else read as module `….py`'s attribute `py`: a confusing import error
        raise TaskError(f"reward {path!r}: name the function in the file too, as '{path}:function'")
    if ":" in path:
        module_name, _, attr = path.rpartition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise TaskError(
            f"reward {path!r}: expected a built-in name ({', '.join(BUILTIN_REWARDS)}), 'package.module:function', "
            "'package.module.function' or 'path/to/file.py:function'"
        )
    module = _import(path, module_name)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise TaskError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TaskError(f"reward {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _import(path: str, module_name: str) -> types.ModuleType:
    """The module of a reward: a file (`.py`) or an importable name; any failure while importing it is one line
    naming the file and line."""
    file = Path(module_name)
    try:
        if module_name.endswith(".py"):
            if not file.is_file():
                raise TaskError(f"reward {path!r}: file {module_name!r} does not exist")
            name = FILE_MODULE_PREFIX + re.sub(r"\W", "_", str(file.resolve()))
            spec = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and pickling look a module up there
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(module_name)
    except TaskError:
        raise
    except (Exception, SystemExit) as err:  # a reward module that fails to import, however it fails
        raise TaskError(f"reward {path!r}: cannot import {module_name!r}: {_where(err)}") from None


def _where(err: BaseException) -> str:
    """`Type: message (file line N)` of an import failure, the line from the innermost frame or the syntax error."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = f"{type(err).__name__}: {message}" if message else type(err).__name__
    if isinstance(err, SyntaxError) and err.filename:
        return f"{type(err).__name__}: {err.msg} ({err.filename} line {err.lineno}, column {err.offset})"
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None and not isinstance(err, ModuleNotFoundError):
        text += f" ({tb.tb_frame.f_code.co_filename} line {tb.tb_lineno})"
    return text


def describe(fn: Callable, name: str, weight: float = 1.0, source: str = "") -> RewardFunction:
    """Tell a function's calling convention from its parameters (see the module docstring)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as err:
        raise TaskError(f"reward {name!r}: cannot read its parameters ({err})") from None
    names = list(params)
    kinds = {p.kind for p in params.values()}
    var_kw = inspect.Parameter.VAR_KEYWORD in kinds
    positional = [
        n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    # A callable object whose __call__ is a coroutine function is async too.
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    spec = RewardFunction(fn, name, weight, is_async=is_async, source=source)
    if {"prompts", "completions"} <= set(names) or names[:2] == ["prompts", "completions"]:
        spec.convention = "trl"
    elif set(_VERL_BATCH) <= set(names):
        spec.convention, spec.wants_extra_info = "verl_batch", "extra_infos" in names or var_kw
    elif set(_VERL) <= set(names):
        spec.convention, spec.wants_extra_info = "verl", "extra_info" in names or var_kw
    elif names[:1] == ["responses"]:
        spec.convention = "ours_batch"
    elif len(positional) >= 3 or inspect.Parameter.VAR_POSITIONAL in kinds:
        spec.convention, spec.wants_row = "ours", "row" in names or var_kw
    else:
        keyword_only = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
        hint = f" ({', '.join(keyword_only)} keyword-only: ours passes them by position)" if keyword_only else ""
        raise TaskError(
            f"reward {name!r}: cannot tell how to call it from its parameters ({', '.join(names) or 'none'}){hint}: "
            "expected fn(response, answer, sample), compute_score(data_source, solution_str, ground_truth, "
            "extra_info) or f(prompts, completions, **kwargs)"
        )
    return spec
