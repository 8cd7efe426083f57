"""docs/metrics.md documents every metric key the package logs to metrics.jsonl, each once, and nothing else.

The keys are found in the source without importing it (no torch): string constants and f-string templates of the
metric groups anywhere under megatron_rl/, and the ungrouped keys the step's stats get by subscript or `update`
in the modules that build the step record. A key a new metric adds fails here until the doc has a row for it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_rl"
DOC = ROOT / "docs" / "metrics.md"

GROUPS = (
    "reward", "response", "rollout", "batch", "loss", "ppo", "kl", "policy", "is", "mismatch", "staleness", "time",
    "throughput", "sync", "buffer", "dynamic", "guard", "eval", "engines", "distill", "routing",
)  # fmt: skip
"""Every metric group: a string `<group>/<name>` anywhere in the package is a metric key."""
KEY = re.compile(rf"^(?:{'|'.join(GROUPS)})/[\w@/]+$")
TEMPLATE = re.compile(rf"^(?:{'|'.join(GROUPS)})/[\w@/{{}}]*\{{\}}[\w@/{{}}]*$")
"""An f-string key with a placeholder (rendered as `{}`): a family of keys."""
SLASHED = re.compile(r"^[a-z_]+/[\w@]+$")
"""What looks like a metric key in the metric modules, whatever its group."""

FAMILIES = {
    "reward/{}": "reward/<name>",  # metrics/step.py reward_components: one key per reward component
    "reward/{}_component": "reward/<name>_component",  # the same for a component named mean, std or max
    "eval/pass@{}": "eval/pass@k",  # rollout/pass_at_k.py eval_scores: k = 1, 2, 4, ..., eval.n
    "eval/mean@{}": "eval/mean@k",
}
"""f-string families of keys -> the pattern the doc lists them under."""
NESTED = {
    "staleness/histogram": "staleness/histogram/<k>",
    "buffer/dropped_by_reason": "buffer/dropped_by_reason/<reason>",
}
"""Keys whose value is an object: the logger flattens it for TensorBoard and wandb into these."""
RECORD_FIELDS = {"step", "wall_s", "record", "version"}
"""Ungrouped keys the scan does not see: the logger's own fields (`step`, `wall_s`, `KIND_KEY`) and the
`version` of `metrics/step.py` collect_metrics (a dict literal key)."""
NOT_METRICS = {"tok/s"}
"""Strings of the metric modules that look like keys of an unknown group but are not keys: `tok/s` is a console
label (metrics/console.py)."""

METRIC_MODULES = (
    "algorithms", "metrics", "trainer/learner.py", "trainer/train_step.py", "trainer/loop.py",
    "rollout/evaluation.py", "rollout/pass_at_k.py",
)  # fmt: skip
"""Where the step record is built (relative to megatron_rl/): ungrouped keys and unknown groups are looked for
here only (elsewhere `out["..."]` and `a/b` strings are other things)."""
STATS_NAMES = {"stats", "out", "record", "extra", "metrics"}
"""Names of the step's stats dictionaries in the metric modules."""


@dataclasses.dataclass
class Found:
    keys: set[str] = dataclasses.field(default_factory=set)
    templates: set[str] = dataclasses.field(default_factory=set)
    ungrouped: set[str] = dataclasses.field(default_factory=set)
    unknown: set[str] = dataclasses.field(default_factory=set)


def _str_defaults(func: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    """A function's parameters with a string default (e.g. `prefix="is/"`), so `f"{prefix}ess"` resolves."""
    args = func.args
    positional = [*args.posonlyargs, *args.args]
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {a.arg: d.value for a, d in pairs if isinstance(d, ast.Constant) and isinstance(d.value, str)}


def _render(node: ast.JoinedStr, defaults: dict[str, str]) -> str:
    """An f-string with string-default parameters filled in and every other placeholder as `{}`."""
    parts = []
    for value in node.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
        elif isinstance(value.value, ast.Name) and value.value.id in defaults:
            parts.append(defaults[value.value.id])
        else:
            parts.append("{}")
    return "".join(parts)


def _stats_key(target: ast.expr) -> str | None:
    """`stats["key"]` (a store into one of the step's stats dictionaries) -> key."""
    if (
        isinstance(target, ast.Subscript)
        and isinstance(target.value, ast.Name)
        and target.value.id in STATS_NAMES
        and isinstance(target.slice, ast.Constant)
        and isinstance(target.slice.value, str)
    ):
        return target.slice.value
    return None


def scan(source: str, metric_module: bool, found: Found | None = None) -> Found:
    """The metric keys in one module's source (see the module docstring)."""
    found = found if found is not None else Found()

    def visit(node: ast.AST, defaults: dict[str, str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defaults = {**defaults, **_str_defaults(node)}
        if isinstance(node, ast.JoinedStr):
            text = _render(node, defaults)
            if KEY.match(text):
                found.keys.add(text)
            elif TEMPLATE.match(text):
                found.templates.add(text)
            return  # its pieces are not keys, and keys in its expressions are read there, not logged
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if KEY.match(node.value):
                found.keys.add(node.value)
            elif metric_module and SLASHED.match(node.value):
                found.unknown.add(node.value)
        if metric_module and isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    key = _stats_key(item)
                    if key is not None and "/" not in key:
                        found.ungrouped.add(key)
        if metric_module and isinstance(node, ast.Call):
            func = node.func
            is_update = isinstance(func, ast.Attribute) and func.attr == "update"
            if is_update and isinstance(func.value, ast.Name) and func.value.id in STATS_NAMES:
                found.ungrouped.update(k.arg for k in node.keywords if k.arg is not None)
        for child in ast.iter_child_nodes(node):
            visit(child, defaults)

    visit(ast.parse(source), {})
    return found


def _is_metric_module(path: Path) -> bool:
    relative = path.relative_to(PACKAGE).as_posix()
    return any(relative == m or relative.startswith(m + "/") for m in METRIC_MODULES)


@functools.cache
def package_keys() -> Found:
    """Every metric key of the package's source (read once per session)."""
    found = Found()
    for path in sorted(PACKAGE.rglob("*.py")):
        scan(path.read_text(), _is_metric_module(path), found)
    return found


def documented_keys(text: str) -> list[str]:
    """The key of every table row of the doc (its first cell, one backticked key), in order."""
    keys = []
    for line in text.splitlines():
        if line.startswith("| `"):
            cell = line.split("|")[1].strip()
            match = re.fullmatch(r"`([^`]+)`", cell)
            assert match, f"a table row's first cell must be one key in backticks: {line!r}"
            keys.append(match.group(1))
    return keys


def undocumented(found: Found, documented: set[str]) -> list[str]:
    """What the code logs that the doc lacks (keys, families and their patterns, flattened objects)."""
    prefixes = {t[: -len("{}")] for t in FAMILIES if t.endswith("{}")}  # `startswith` lookups of a family
    missing = [k for k in found.keys if k not in documented and k not in prefixes]
    missing += [f"{t} (new f-string family: add it to FAMILIES)" for t in found.templates if t not in FAMILIES]
    missing += [FAMILIES[t] for t in found.templates if t in FAMILIES and FAMILIES[t] not in documented]
    missing += [k for k in found.ungrouped | RECORD_FIELDS if k not in documented]
    missing += [p for k, p in NESTED.items() if k in found.keys and p not in documented]
    return sorted(missing)


def test_the_scan_finds_the_metrics():
    found = package_keys()
    assert len(found.keys) > 60
    assert {"reward/mean", "ppo/clip_frac", "mismatch/k3_kl", "eval/reward_mean", "sync/resyncs"} <= found.keys
    assert "is/ess" in found.keys  # f"{prefix}ess" with prefix="is/"
    assert set(FAMILIES) == found.templates
    assert {"loss", "grad_norm", "grad_norm_max", "lr"} <= found.ungrouped
    assert set(NESTED) <= found.keys


def test_every_logged_key_is_documented():
    documented = set(documented_keys(DOC.read_text()))
    assert undocumented(package_keys(), documented) == [], "metric keys missing from docs/metrics.md"


def test_no_key_is_documented_twice():
    counts = Counter(documented_keys(DOC.read_text()))
    assert sorted(k for k, n in counts.items() if n > 1) == []


def test_every_documented_key_is_logged():
    found = package_keys()
    known = found.keys | found.ungrouped | RECORD_FIELDS | set(FAMILIES.values()) | set(NESTED.values())
    assert sorted(set(documented_keys(DOC.read_text())) - known) == []


def test_no_unknown_metric_group():
    assert sorted(package_keys().unknown - NOT_METRICS) == [], "a new metric group: add it to GROUPS and the doc"


def test_a_new_key_fails_until_documented():
    source = """
def stats(x, prefix="is/"):
    out = {"ppo/new_frac": x, f"{prefix}new_weight": x, f"eval/best@{x}": x, "newgroup/thing": x}
    out["new_ungrouped"] = x
    out.update(another=x)
    return out
"""
    found = scan(source, metric_module=True)
    assert undocumented(found, {"ppo/new_frac"}) == [
        "another",
        "eval/best@{} (new f-string family: add it to FAMILIES)",
        "is/new_weight",
        "new_ungrouped",
        "record",
        "step",
        "version",
        "wall_s",
    ]
    assert found.unknown == {"newgroup/thing"}
    assert "path/to/file" not in scan('"path/to/file"', metric_module=False).unknown
