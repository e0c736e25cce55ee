"""One progress bar per job (issue 23, item 6): transformers' GGUF load draws a tqdm bar of its
own, which every rank drew; ranks other than 0 draw none."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.limits import patient

_RANK = """
import sys
import torch  # imports tqdm (torch.hub) before the rank is quieted, as in a worker
from shardkit._quiet import quiet_third_party
quiet_third_party(int(sys.argv[1]))
from tqdm.auto import tqdm
for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
    pass
"""


@pytest.mark.parametrize(("rank", "bar"), [(0, True), (1, False), (3, False)])
def test_only_rank_0_draws_a_tqdm_bar(rank, bar):
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    run = subprocess.run(
        [sys.executable, "-c", _RANK, str(rank)], capture_output=True, text=True, timeout=patient(120), env=env_free
    )
    assert run.returncode == 0, run.stderr
    assert ("GGUF tensors" in run.stderr) is bar, run.stderr
