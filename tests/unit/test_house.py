"""The house rules, checked on the source: the layers of docs/architecture.md and no import circle, module and
function sizes, function-level imports only with a reason, and a `megatron-rl --help` that imports no torch,
Ray or vLLM."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_rl"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_FUNCTION_IMPORTS = 66  # each CLI command imports its heavy module when it runs; each patch what it patches


def module_name(path: Path) -> str:
    """`megatron_rl/a/b.py` -> `megatron_rl.a.b`; a package's `__init__.py` is the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of every node under an `if TYPE_CHECKING:` block (imports for annotations only)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped |= {id(n) for n in ast.walk(child)}
    return skipped


def imports_of(path: Path) -> set[str]:
    """The package modules `path` imports (anywhere in it but under TYPE_CHECKING); `from pkg import mod` counts
    as an import of `pkg.mod` when that is a module."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {name for name in found if name in MODULES}


def layer_table() -> dict[str, int]:
    """Module prefix -> layer, from the table under "## Layers" in docs/architecture.md."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for layer, cell in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, flags=re.M):
        for entry in re.findall(r"`([^`]+)`", cell):
            prefix = "megatron_rl." + entry.removesuffix("/").removesuffix(".py").replace("/", ".")
            table[prefix] = int(layer)
    return table


def layer_of(module: str, table: dict[str, int]) -> int | None:
    """The layer of the most specific table entry that names `module` (itself or a package above it)."""
    if module == "megatron_rl":
        return 0
    matches = [p for p in table if module == p or module.startswith(p + ".")]
    return table[max(matches, key=len)] if matches else None


def test_every_module_has_a_layer_and_imports_none_above_it():
    table = layer_table()
    assert len(table) >= 10, f"could not read the layer table of docs/architecture.md: {table}"
    unplaced = [m for m in MODULES if layer_of(m, table) is None]
    assert not unplaced, f"modules the layer table of docs/architecture.md does not place: {unplaced}"
    upward = []
    for module, path in MODULES.items():
        mine = layer_of(module, table)
        for target in imports_of(path):
            theirs = layer_of(target, table)
            if theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_circle():
    graph = {module: imports_of(path) - {module} for module, path in MODULES.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_modules_and_functions_are_short():
    too_long = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{module}: {lines} lines (> {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {length} lines (> {MAX_FUNCTION_LINES})")
    assert not too_long, "\n".join(too_long)


def function_level_imports() -> list[tuple[str, int, str]]:
    """(module, line, source line) of every import inside a function, under TYPE_CHECKING or not."""
    found = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        found.append((module, sub.lineno, lines[sub.lineno - 1]))
    return found


def test_function_level_imports_are_few_and_each_says_why():
    imports = function_level_imports()
    assert len(imports) < MAX_FUNCTION_IMPORTS, f"{len(imports)} imports inside functions: {imports}"
    unexplained = []
    for module, line, text in imports:
        # the reason on the line itself, or on the comment line right above it
        above = MODULES[module].read_text().splitlines()[line - 2].strip()
        if "#" not in text and not above.startswith("#"):
            unexplained.append(f"{module}:{line}: {text.strip()}")
    assert not unexplained, "imports inside functions without a reason:\n" + "\n".join(unexplained)


@pytest.mark.parametrize(
    "argv", [["--help"], ["verify", "sync", "--help"], ["verify", "routing", "--help"], ["train", "--help"]]
)
def test_help_imports_no_torch_ray_or_vllm(argv):
    probe = (
        "import sys\nfrom megatron_rl.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'ray', 'vllm', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_engine_side_weight_path_imports_no_megatron():
    """vLLM workers load it; a GPU vLLM image need not have Megatron, and importing it costs seconds."""
    probe = (
        "import sys\nimport megatron_rl.weights.engine.worker\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('megatron', 'ray')}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
