"""Pipeline stages under sequence parallelism exchange each tp rank's sequence block (issue 33).

``shardkit train --pp 2 --tp 2`` (SP on by default) passes ``--verify`` (float64, 1e-9 against one
process) with the boundary carrying ``[b, S_r, H]``: an uneven sequence (15 tokens over 2 tp ranks:
blocks of 8 and 7) under 1F1B, chunked stages (interleaved 1F1B, v = 2) and a V with its I/W
split (ZBV); FSDP2 beside it in the slow tier. tests/parallelize/test_sp_boundary.py counts the
bytes that cross; tests/plan/test_ledger.py holds them to the planner.
"""

import time

import pytest
import torch

from harness.helpers import rank, world_size
from harness.tiers import tiered
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

SMALL = dict(steps=2, seq_len=15, batch_size=4, dtype="float64", verify=True, layers=4, lr=1e-3, tp=2, pp=2)


def _verified(**overrides) -> None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    assert cfg.sequence_parallel
    result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    if rank() != 0:
        assert result is None
        return
    parity = result["parity"]
    assert parity["passed"] and parity["max_param_rel_diff"] <= 1e-9, parity


CASES = {
    "1f1b, uneven blocks (8 + 7 tokens)": dict(schedule="1f1b", microbatches=2),
    "interleaved-1f1b v2 (every chunk boundary a block)": dict(
        schedule="interleaved-1f1b", virtual_stages=2, microbatches=2
    ),
    "zbv v2, --ac selective (I/W split, the V's turn local)": dict(
        schedule="zbv", virtual_stages=2, microbatches=2, ac="selective"
    ),
    "zbv v2 under --checks (every block's header judged)": dict(
        schedule="zbv", virtual_stages=2, microbatches=2, checks=True
    ),
}
# Quick tier: uneven blocks (1F1B) and a V with its I/W split and recompute; interleaved chunks
# train in the quick ledger case of tests/plan/test_ledger.py, the checked run is the slow tier's.
QUICK = ("1f1b, uneven blocks (8 + 7 tokens)", "zbv v2, --ac selective (I/W split, the V's turn local)")


@pytest.mark.world(4, timeout=300)
@pytest.mark.parametrize("overrides", tiered(CASES, QUICK))
def test_sp_pipeline_verifies_with_sequence_block_boundaries(overrides):
    _verified(**overrides)


@pytest.mark.slow
@pytest.mark.world(8, timeout=400)
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_sp_pipeline_verifies_with_fsdp2(schedule, v):
    """pp 2 x dp_shard 2 x tp 2: FSDP2 gathers each stage's groups once, the blocks cross."""
    _verified(schedule=schedule, virtual_stages=v, microbatches=2, dp_shard=2, ac="full")
