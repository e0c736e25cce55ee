"""Every script under ``scripts/`` and ``benchmarks/`` still runs: each answers ``--help`` with exit
status 0 and a usage line, in a fresh interpreter with this checkout's ``src`` first on the path.

A script that imports a module or a name which no longer exists (the fate of two benchmarks
before issue 20) fails here too: every import statement of every Python script, at the top or
inside a function, is resolved in this process (where torch is already imported). A script imports
torch after parsing its arguments, so that its ``--help`` answers in a fraction of a second instead
of seconds of an import. The list is read from the folders, so a new script is covered without
editing this file. Packages of helpers beside a script (like
``scripts/faults/``) are imported by their script and are not scripts themselves.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.limits import patient

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.relative_to(ROOT).as_posix() for folder in ("scripts", "benchmarks") for p in (ROOT / folder).glob("*.[ps][yh]")
)


def test_the_script_list_is_not_empty():
    assert "scripts/fault_trials.py" in SCRIPTS and "scripts/check_floors.sh" in SCRIPTS
    assert any(s.startswith("benchmarks/") for s in SCRIPTS)


LOCAL_PATHS = (ROOT / "tests" / "catalogue",)


def _unresolved(script: str) -> list[str]:
    """The import statements of ``script`` (at any depth) that name a missing module or name."""
    folder = (ROOT / script).parent
    missing = []
    for node in ast.walk(ast.parse((ROOT / script).read_text())):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, alias.name) for alias in node.names]
        else:
            continue  # relative imports live in the helper packages, imported by their script
        for module, name in wanted:
            # a helper package beside the script, or a module of the folders a script puts on its
            # sys.path (bad_input_table.py: the catalogue's): its file must exist
            homes = [d for d in (folder, *LOCAL_PATHS) if (d / module.split(".")[0]).exists()]
            homes += [d for d in (folder, *LOCAL_PATHS) if (d / f"{module.split('.')[0]}.py").is_file()]
            if homes:
                local = homes[0] / module.replace(".", "/")
                if not (local.with_suffix(".py").is_file() or (local / "__init__.py").is_file()):
                    missing.append(f"line {node.lineno}: {module}: no such file in {homes[0]}")
                continue
            try:
                mod = importlib.import_module(module)
                if name is not None and not hasattr(mod, name):
                    importlib.import_module(f"{module}.{name}")
            except ImportError as e:
                missing.append(f"line {node.lineno}: {module} {name or ''}: {e}")
    return missing


@pytest.mark.meta  # imports every module the scripts use (torch._dynamo among them: seconds, alone)
def test_every_import_of_every_script_resolves():
    assert {s: m for s in SCRIPTS if s.endswith(".py") and (m := _unresolved(s))} == {}


def test_a_missing_module_or_name_is_found(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text(
        "import os\nfrom shardkit.train.config import TrainConfig\ndef f():\n"
        "    from shardkit.train import gone_module\n    import shardkit.no_such\n"
        "    from shardkit.train.config import NoSuchName\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = _unresolved("s.py")
    assert [f.split(":")[0] for f in found] == ["line 4", "line 5", "line 6"], found


@pytest.mark.meta
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_answers_help(script):
    runner = ["bash"] if script.endswith(".sh") else [sys.executable]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [*runner, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=patient(120), env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.lower().startswith("usage:"), proc.stdout[:500]


@pytest.mark.meta
def test_gpu_first_checks_dry_run_lists_every_step_and_writes_nothing(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run(
        ["bash", "scripts/gpu_first_checks.sh", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patient(120),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [line.split()[0] for line in proc.stdout.splitlines() if "<=" in line]
    assert steps[:6] == ["env", "fake_tier", "blocks", "attention", "train_1gpu", "syncs"], proc.stdout
    assert {"nccl_tp", "nccl_fsdp2", "nccl_ring", "nccl_ulysses", "nccl_pp", "nccl_moe", "nccl_checks"} <= set(steps)
    assert all(int(line.split("<=")[1].split("s")[0]) <= 150 for line in proc.stdout.splitlines() if "<=" in line)
    assert not out.exists()
