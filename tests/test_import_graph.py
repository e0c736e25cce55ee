"""The package's import graph (issue 20): no import circle between the files or the folders of
``src/shardkit`` (library wings, application, command line, bench), and no shardkit import hidden
inside a function body (such imports hid circles). Read from the source with ``ast``: nothing is
imported."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardkit"


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The shardkit modules an ``import from`` names (a name that is a submodule counts as it)."""
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    if not name.startswith("shardkit"):
        return []
    out = []
    for alias in node.names:
        sub = f"{name}.{alias.name}"
        exists = (SRC.parent / Path(*sub.split("."))).with_suffix(".py").exists()
        out.append(sub if exists else name)
    return out


def _files():
    yield from sorted(SRC.rglob("*.py"))


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(shardkit modules imported, function-local shardkit imports as 'file:line')."""
    tree = ast.parse(path.read_text())
    module, is_package = _module(path), path.name == "__init__.py"
    local = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {id(n) for n in ast.walk(fn)}
    targets, hidden = set(), []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            names = _target(node, module, is_package)
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("shardkit")]
        # cli/ may import a command's module inside the function that runs it: `shardkit --help`
        # must not pay for torch (issue 23). Such imports still count as edges of the graph below.
        if names and id(node) in local and not module.startswith("shardkit.cli"):
            hidden.append(f"{path.relative_to(SRC)}:{node.lineno}")
        targets.update(names)
    return targets, hidden


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (a path that comes back to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _graph():
    files = {}
    for path in _files():
        files[_module(path)] = _imports(path)
    return files


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (SRC / parts[-1]).is_dir() else module


def test_no_shardkit_import_inside_a_function_body():
    hidden = [h for _, (_, hs) in _graph().items() for h in hs]
    assert not hidden, f"function-local shardkit imports (move them to the top of the module): {hidden}"


def test_no_circle_between_library_files():
    graph = {m: {t for t in targets if t != m} for m, (targets, _) in _graph().items()}
    assert _cycle(graph) is None, f"file circle: {' -> '.join(_cycle(graph) or [])}"


def test_no_circle_between_library_folders():
    graph: dict[str, set[str]] = {}
    for m, (targets, _) in _graph().items():
        graph.setdefault(_folder(m), set()).update(_folder(t) for t in targets if _folder(t) != _folder(m))
    assert _cycle(graph) is None, f"folder circle: {' -> '.join(_cycle(graph) or [])}"


@pytest.mark.parametrize(
    ("graph", "circle"),
    [({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]), ({"a": {"b"}, "b": {"c"}, "c": set()}, None)],
)
def test_the_circle_finder_finds_circles(graph, circle):
    assert _cycle(graph) == circle
