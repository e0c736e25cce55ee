"""Every script under ``scripts/`` and ``benchmarks/`` still runs: each answers ``--help`` with exit
status 0 and a usage line, in a fresh interpreter with this checkout's ``src`` first on the path.

``--help`` imports the script's whole module, so a script that imports a module which no longer
exists (the fate of two benchmarks before issue 20) fails here. The list is read from the folders,
so a new script is covered without editing this file. Packages of helpers beside a script (like
``scripts/faults/``) are imported by their script and are not scripts themselves.
"""

from __future__ import annotations

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
