"""YAML loading, dotted command-line overrides, and validation errors that name field, value and what is allowed."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from megatron_rl.config.run import RunConfig
from megatron_rl.errors import UserError


class ConfigError(UserError, ValueError):
    """A config file or override that does not fit the schema; the message names every problem."""


class _RepeatedKey(yaml.YAMLError):
    """A mapping that gives one key twice; the message says where, in one line."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently; a
    merge key's entries may still be overridden)."""

    def construct_mapping(self, node, deep=False):
        """The mapping, once no key of its own appears twice."""
        first: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue  # unhashable keys: PyYAML's own error
            if key in first:
                at, before = key_node.start_mark, first[key]
                raise _RepeatedKey(
                    f"line {at.line + 1}, column {at.column + 1}: the key {key!r} is given twice (first at line "
                    f"{before.line + 1})"
                )
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (['a','b','c'], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected dotted.key=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': empty key part")
    try:
        value = _load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}': value is not valid YAML ({err})") from None
    return key.split("."), value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    """Set data[path[0]][path[1]]... = value, creating sections as needed; a number indexes a list the config
    already holds (`task.datasets.0.weight=2`)."""
    node: Any = data
    for depth, part in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(node, list):
            where = ".".join(path[:depth])
            if not (part.isdigit() and int(part) < len(node)):
                raise ConfigError(
                    f"override {'.'.join(path)}: '{where}' is a list of {len(node)}: index it with 0 to {len(node) - 1}"
                    f", or set the whole list ({where}=[...])"
                )
            if last:
                node[int(part)] = value
                return
            node = node[int(part)]
            continue
        if last:
            node[part] = value
            return
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"override {'.'.join(path)}: '{part}' is a value, not a section")
        node = child


def _model_at(path: tuple, root: type[BaseModel] = RunConfig) -> type[BaseModel] | None:
    model = root
    for part in path:
        if isinstance(part, int):
            continue  # an index into a list of sections: the list's field gave the element's model
        annotation = getattr(model.model_fields.get(str(part)), "annotation", None)
        inner = [a for a in typing.get_args(annotation) or (annotation,) if isinstance(a, type)]
        sections = [a for a in inner if issubclass(a, BaseModel)]  # `Section`, `list[Section]`, `Section | None`
        if not sections:
            return None
        model = sections[0]
    return model


def _describe_error(err: dict) -> str:
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1])
        known = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean '{'.'.join(str(p) for p in loc[:-1] + (close[0],))}'?" if close else ""
        return f"{where}: unknown field{hint} (known: {', '.join(known)})"
    got = err.get("input")
    message = err["msg"].removeprefix("Value error, ")
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        message = f"must be one of {ctx['expected']}"
    if not loc:  # a check across fields: its message names them, and the input is the whole config
        return message
    return f"{where}: {message} (got {got!r})"


def validate(data: dict, source: str = "config") -> RunConfig:
    """Build a RunConfig, turning pydantic's errors into one ConfigError that lists each problem."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        lines = [_describe_error(e) for e in err.errors()]
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML file (or defaults when `path` is None), apply dotted overrides, validate."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = _load_yaml(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config file ({err})") from None
        if loaded is None:
            raise ConfigError(f"{path}: the file holds no settings (for the defaults, name no config file)")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    for text in overrides or []:
        keys, value = parse_override(text)
        apply_override(data, keys, value)
    return validate(data, source)


def dump_config(config: RunConfig) -> str:
    """The config as YAML (what a run records next to its outputs)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def explain(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """One line per field: dotted name, type, default and docstring."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += explain(annotation, f"{prefix}{name}.")
            continue
        default = field.default if field.default_factory is None else field.default_factory()
        type_name = getattr(annotation, "__name__", str(annotation)).replace("typing.", "")
        lines.append(f"{prefix}{name} ({type_name}, default {default!r}): {field.description or ''}")
    return lines
