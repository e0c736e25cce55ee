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
