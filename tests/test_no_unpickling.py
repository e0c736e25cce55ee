"""The library never unpickles what a peer or another user wrote: no object collectives (they
pickle on one rank and unpickle on another), no ``pickle.load(s)``, no ``torch.load`` without
``weights_only=True`` (DCP's ``.metadata`` is read by an allow-list ``Unpickler`` subclass,
:mod:`shardkit.checkpoint.reader`). Read from the source's syntax tree, so a new call site fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import shardkit

_OBJECT_COLLECTIVES = {
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            yield node, owner, name


def _unsafe(path: Path, rel: str) -> list[str]:
    found = []
    for node, owner, name in _calls(ast.parse(path.read_text(), str(path))):
        where = f"{rel}:{node.lineno}"
        if name in _OBJECT_COLLECTIVES:
            found.append(f"{where}: {name} (pickles on one rank, unpickles on another)")
        elif owner == "pickle" and name in ("load", "loads"):  # DCP's reader: an allow-list Unpickler
            found.append(f"{where}: pickle.{name}")
        elif owner == "torch" and name == "load":
            weights_only = [k for k in node.keywords if k.arg == "weights_only"]
            if not (weights_only and isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value):
                found.append(f"{where}: torch.load without weights_only=True")
    return found


def test_the_library_unpickles_nothing_a_peer_wrote():
    root = Path(shardkit.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 100  # the whole package was read
    found = [f for p in files for f in _unsafe(p, p.relative_to(root).as_posix())]
    assert found == []


def test_the_scan_finds_each_unsafe_call(tmp_path):
    # The scan can fail: each pattern it forbids, planted in a file, is reported.
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import pickle, torch\nimport torch.distributed as dist\n"
        "dist.all_gather_object(out, x)\npickle.loads(b)\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
        "torch.load(f, weights_only=True)\n"
    )
    found = _unsafe(planted, "planted.py")
    assert [f.split(":")[1] for f in found] == ["3", "4", "5", "6"], found
