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

# One interpreter imports torch (which imports tqdm through torch.hub before any rank is quieted,
# as in a worker), then forks one child per case, as the launcher's forkserver forks the ranks
# from a process with torch imported: each child quiets itself as that rank (or not), draws the
# bar, and its stderr goes to a file of its own. One torch import instead of one per case.
_RANKS = """
import os
import sys
import torch
from shardkit._quiet import quiet_third_party

out = sys.argv[1]
for case in sys.argv[2:]:
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(out, case), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        try:
            if case != "unquieted":
                quiet_third_party(int(case))
            from tqdm.auto import tqdm

            for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
                pass
            sys.stderr.flush()
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        sys.exit(f"case {case}: exit status {status}")
"""
CASES = ("unquieted", "0", "1", "3")


@pytest.fixture(scope="module")
def bars(tmp_path_factory) -> dict[str, str]:
    """What each case's process printed on stderr: ``case -> text``."""
    out = tmp_path_factory.mktemp("bars")
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    run = subprocess.run(
        [sys.executable, "-c", _RANKS, str(out), *CASES],
        capture_output=True,
        text=True,
        timeout=patient(120),
        env=env_free,
    )
    assert run.returncode == 0, run.stderr + "".join((out / c).read_text() for c in CASES if (out / c).exists())
    return {case: (out / case).read_text() for case in CASES}


# rank 3 takes rank 1's path (quiet_third_party tells rank 0 from the others): CI only
@pytest.mark.parametrize(
    ("rank", "bar"), [("unquieted", True), (0, False), (1, False), pytest.param(3, False, marks=pytest.mark.slow)]
)
def test_no_rank_draws_a_tqdm_bar(bars, rank, bar):
    # "unquieted": the same process without quiet_third_party draws the bar (the test can fail)
    text = bars[str(rank)]
    assert ("GGUF tensors" in text) is bar, text


def test_export_turns_the_bars_off_before_it_loads_anything(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cli_export, "no_progress_bars", lambda: calls.append("bars off"))
    assert main(["export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path / "hf")]) == 2
    assert calls == ["bars off"]  # before find_save refused the missing directory
