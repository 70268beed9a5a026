"""The structure of src/hamburger, read from its own source: layers that only point down, no import circles, no
module that imports the CLI, no private name used outside the module that defines it, files of a readable size.

Imports are read with `ast`, those inside functions included (a deferred import is still a dependency). The layer
rule leaves out those under `if TYPE_CHECKING:` (they name types only and never run); the circle rule counts them:
two modules that name each other's types are one concept split in two, or a type in the wrong module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hamburger"

# Lowest first: a module may import its own layer and those below it, never one above.
LAYERS = [
    {"errors"},
    {"model"},
    {"kernels"},
    {"inference"},
    {"loading", "training"},
    {"serving", "vllm"},
    {"evaluation"},
    {"cli", "__main__"},
]
# A file fits in a head; a module that is one concept may run to this many lines.
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def runtime_imports(path: Path, typing: bool = False) -> set[str]:
    """The hamburger modules `path` imports at run time (inside functions too), and with `typing` those it imports
    under TYPE_CHECKING too."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    known = sources()
    return {n for n in names if n in known and n.startswith("hamburger.")}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, tops in enumerate(LAYERS):
        if top in tops:
            return rank
    raise AssertionError(f"{module}: a top-level module with no layer: add it to LAYERS")


def graph(typing: bool = False) -> dict[str, set[str]]:
    return {m: runtime_imports(p, typing) - {m} for m, p in sources().items() if m != "hamburger"}


def test_every_import_points_down():
    upward = [f"{m} -> {d}" for m, deps in graph().items() for d in deps
              if d != "hamburger" and layer(d) > layer(m)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_no_module_outside_the_cli_imports_it():
    bad = [f"{m} -> {d}" for m, deps in graph().items() for d in deps
           if d.startswith("hamburger.cli") and not m.startswith(("hamburger.cli", "hamburger.__main__"))]
    assert not bad, bad


def circles(typing: bool) -> list[list[str]]:
    """The import circles of src/hamburger (with `typing`: TYPE_CHECKING imports counted), each as a path."""
    deps = {m: {d for d in ds if d != "hamburger"} for m, ds in graph(typing).items()}
    # a package's __init__ imported as a name's parent is not a dependency on its modules
    seen, stack, found = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            found.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(deps.get(m, ())):
            visit(d)
        stack.pop()

    for m in sorted(deps):
        visit(m)
    return found


@pytest.mark.parametrize("typing", [False, True], ids=["run time", "TYPE_CHECKING included"])
def test_no_import_circles(typing):
    found = circles(typing)
    assert not found, "\n".join(" -> ".join(c) for c in found)


def private_definitions() -> dict[str, set[str]]:
    """Each module's private names: functions, classes, module-level names and attributes it sets on self."""
    defs: dict[str, set[str]] = {}
    for m, p in sources().items():
        names = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        defs[m] = {n for n in names if n.startswith("_") and not n.startswith("__")}
    return defs


def test_no_private_name_is_used_outside_its_module():
    defs = private_definitions()
    bad = []
    for m, p in sources().items():
        foreign = set().union(*(d for o, d in defs.items() if o != m)) - defs[m]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hamburger"):
                bad += [f"{m}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr in foreign:
                receiver = ast.unparse(node.value)
                if receiver not in ("self", "cls") and not receiver.startswith(("torch", "super()")):
                    bad.append(f"{m}:{node.lineno}: {receiver}.{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_source_files_stay_readable(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)}: {lines} lines (at most {MAX_LINES}): split it by concern"


MAX_FUNCTION_LINES = 60


def test_functions_stay_readable():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}: {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
