"""The code style is enforced, not advised: ``ruff format`` and ``ruff check`` (configured in
pyproject.toml: 120 columns, import sorting, pycodestyle, pyflakes, pyupgrade, bugbear) pass on every
Python file of the project. ruff is pinned in the ``test`` extra, so a new release's rules cannot
fail the suite by themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["src", "tests", "scripts", "benchmarks", "docs"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.meta
def test_ruff_format_leaves_every_file_unchanged():
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.meta
def test_ruff_check_passes():
    proc = _ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
