"""The planner's rows of ``sp_activation="shard"`` equal the trainer's ledger under every ``--ac``.

One training step of :mod:`shardkit.train.run` (tp 2 with sequence parallelism, the shard
layout) per activation checkpointing mode; the ledger's ``sp_regather`` calls (the readers'
all-gather in backward) and, for ``selective``, the blocks' input all-gathers its recompute
issues again (the replay keeps none of them), against
:func:`~shardkit.plan.collectives.step_collectives`: count and bytes. (The other recompute
collectives of a checkpointed block are not in the planner's rows; tests/plan/test_ledger.py
holds every other row to the ledger without checkpointing.)
"""

import pytest

from harness.helpers import SMALL_CORPUS, rank
from harness.ledger_run import ledger_of_a_run
from shardkit.plan import StepOptions
from shardkit.plan.collectives import ledger_table, merged, step_collectives
from shardkit.plan.options import rank_stage
from shardkit.train.config import TrainConfig, validate_config

CORPUS = SMALL_CORPUS
SMALL = dict(steps=1, seq_len=16, batch_size=4, dtype="float32", verify=False, layers=4, lr=1e-3, tp=2, data=CORPUS)


def _keys(table: dict, ac: str) -> dict:
    return {
        k: v
        for k, v in table.items()
        if k[1] == "sp_regather" or (k[1] == "all_gather" and k[2] == "recompute" and ac == "selective")
    }


@pytest.mark.world(2, timeout=180)
@pytest.mark.parametrize("ac", ["none", "full", "selective", "selective:3"])
def test_the_regather_rows_equal_the_ledger(ac):

    cfg = validate_config(TrainConfig(**{**SMALL, "ac": ac}), world_size=2)
    dims, shape, ledger = ledger_of_a_run(cfg)
    opts = StepOptions(cfg.seq_len, cfg.batch_size, cfg.microbatches, cfg.dtype, True, activation_checkpoint=ac)
    stage, tp_rank = rank_stage(dims, rank())
    want = _keys(merged(step_collectives(shape, dims, opts, stage, tp_rank)), ac)
    got = _keys(ledger_table(ledger.records), ac)
    assert got == want and got, (got, want)
