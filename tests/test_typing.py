"""Typing of the public API: every public signature annotated, and mypy passes (pyproject.toml).

mypy is configured in pyproject.toml: strict on the public modules, lenient (a listed typing
debt) on internals; tests/typecheck/public_api.py is a typed user of the API it checks too.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardkit

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["comm", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline_parallel", "spatial"]


def _public_callables():
    """(qualified name, function) of every function and own method of every name in an __all__."""
    import importlib

    modules = [shardkit] + [importlib.import_module(f"shardkit.{p}") for p in SUBPACKAGES]
    seen = set()
    for mod in modules:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if id(obj) in seen or not getattr(obj, "__module__", "").startswith("shardkit"):
                continue
            seen.add(id(obj))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    if inspect.isfunction(func) and (attr == "__init__" or not attr.startswith("_")):
                        yield f"{mod.__name__}.{name}.{attr}", func
            elif inspect.isfunction(obj):
                yield f"{mod.__name__}.{name}", obj


def test_every_public_signature_is_annotated():
    missing = []
    for qualname, func in _public_callables():
        sig = inspect.signature(func)
        bare = [
            p.name
            for p in sig.parameters.values()
            if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")
        ]
        if bare or (sig.return_annotation is inspect.Signature.empty and not qualname.endswith("__init__")):
            missing.append(
                f"{qualname}: parameters {bare}"
                + (", return" if sig.return_annotation is inspect.Signature.empty else "")
            )
    assert not missing, "unannotated public signatures:\n" + "\n".join(missing)


def test_group_arguments_take_a_process_group_or_mesh():
    # The project's convention: every `group` argument is typed as shardkit.Group.
    wrong = [
        q
        for q, f in _public_callables()
        if "group" in inspect.signature(f).parameters
        and "Group" not in str(inspect.signature(f).parameters["group"].annotation)
    ]
    assert not wrong, wrong


def test_py_typed_ships():
    assert (ROOT / "src" / "shardkit" / "py.typed").is_file()
    assert 'shardkit = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


def _mypy_cache() -> Path:
    """mypy's incremental cache, kept in the user's cache across checkouts and runs: cold, mypy
    spends ~35 core-s reading torch's types (a fresh clone, CI's case); warm, 1.5. mypy checks every
    entry against its source (size, then hash), so a stale or foreign checkout's entry is redone,
    not trusted. conftest points XDG_CACHE_HOME at a session directory, hence the home path;
    MYPY_CACHE_DIR (mypy's own variable) overrides it."""
    path = Path(os.environ.get("MYPY_CACHE_DIR") or Path.home() / ".cache" / "shardkit-dev" / "mypy")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@pytest.mark.meta
def test_mypy_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(_mypy_cache())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
