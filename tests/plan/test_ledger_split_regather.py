"""SP's regather under the zero-bubble ``I``/``W`` split: once per projection group, as the planner counts.

One training step of :mod:`shardkit.train.run` on pp 2 x tp 2 with sequence parallelism and
``sp_activation="shard"`` under ``zb-h1`` and ``zbv`` (their backward split into the input
gradient ``I`` and the weight gradient ``W``, :mod:`shardkit.pipeline_parallel.split_backward`).
A shard-saving projection needs its gathered input only for the weight gradient, so ``I``
gathers nothing and ``W`` gathers once: the ledger's ``sp_regather`` rows (count and bytes, every
rank) equal :func:`~shardkit.plan.collectives.step_collectives`'s, which has one per projection
group and microbatch whatever the schedule. Before this, ``I`` computed the weight gradient too
(and threw it away) and ``W`` gathered again: twice the planned count, which this test catches.
"""

import pytest

from harness.helpers import SMALL_CORPUS, rank
from harness.ledger_run import ledger_of_a_run
from shardkit.plan import StepOptions
from shardkit.plan.collectives import ledger_table, merged, step_collectives
from shardkit.plan.options import rank_stage
from shardkit.train.config import TrainConfig, validate_config

CORPUS = SMALL_CORPUS
SMALL = dict(
    steps=1, seq_len=16, batch_size=4, dtype="float32", verify=False, layers=4, lr=1e-3, tp=2, pp=2, data=CORPUS
)


def _regathers(table: dict) -> dict:
    return {k: v for k, v in table.items() if k[1] == "sp_regather"}


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize(
    "overrides",
    [dict(schedule="zb-h1", microbatches=2), dict(schedule="zbv", virtual_stages=2, microbatches=4)],
    ids=["zb-h1", "zbv"],
)
def test_split_backward_regathers_once(overrides):
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=4)
    dims, shape, ledger = ledger_of_a_run(cfg)
    opts = StepOptions(
        cfg.seq_len,
        cfg.batch_size,
        cfg.microbatches,
        cfg.dtype,
        True,
        schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages,
    )
    stage, tp_rank = rank_stage(dims, rank())
    want = _regathers(merged(step_collectives(shape, dims, opts, stage, tp_rank)))
    got = _regathers(ledger_table(ledger.records))
    assert got == want and got, (rank(), got, want)
