"""No third-party progress bar in a job's output (issue 23, item 6; issue 32, item 6): transformers'
GGUF load draws a tqdm bar of its own, which every rank drew; now no rank draws it, rank 0
included, and neither do ``shardkit export`` and the launcher's pre-launch checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.limits import patient
from shardkit.cli import export as cli_export
from shardkit.cli.main import main

_RANK = """
import sys
import torch  # imports tqdm (torch.hub) before the rank is quieted, as in a worker
from shardkit._quiet import quiet_third_party
if sys.argv[1] != "unquieted":
    quiet_third_party(int(sys.argv[1]))
from tqdm.auto import tqdm
for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
    pass
"""


# rank 3 takes rank 1's path (quiet_third_party tells rank 0 from the others): a launch of its own in CI only
@pytest.mark.parametrize(
    ("rank", "bar"), [("unquieted", True), (0, False), (1, False), pytest.param(3, False, marks=pytest.mark.slow)]
)
def test_no_rank_draws_a_tqdm_bar(rank, bar):
    # "unquieted": the same process without quiet_third_party draws the bar (the test can fail)
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    run = subprocess.run(
        [sys.executable, "-c", _RANK, str(rank)], capture_output=True, text=True, timeout=patient(120), env=env_free
    )
    assert run.returncode == 0, run.stderr
    assert ("GGUF tensors" in run.stderr) is bar, run.stderr


def test_export_turns_the_bars_off_before_it_loads_anything(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cli_export, "no_progress_bars", lambda: calls.append("bars off"))
    assert main(["export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path / "hf")]) == 2
    assert calls == ["bars off"]  # before find_save refused the missing directory
