"""``shardkit train``'s expert capacity flags (issue 34 item 2): ``--moe-capacity-factor``,
``--moe-drop-policy``, ``--moe-pad-to-capacity`` against the one-process reference (``--verify``).

Each case trains 2 steps in float64 and checks on rank 0 that the losses, gradient norms and final
parameters match the reference, and that every step's per-layer expert load and dropped-pair
count, all-reduced over the parallel run, equal the reference's exactly. The reference routes a
whole microbatch of several data ranks (and cp / sp blocks) in one call and applies the capacity
to each of the parallel run's token groups (:mod:`shardkit.train.moe_capacity`); a reference that
applied it to the whole call drops other pairs (``test_grouping_changes_what_drops``). A capacity
factor of 1 with 4 experts, top-2, drops a few percent of the pairs here: every case asserts that
some pairs dropped, so the rule is exercised, and not all.
"""

import time

import pytest
import torch

from harness.helpers import rank, world_size
from harness.tiers import tiered
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3)
CAP = dict(moe_capacity_factor=1.0)
POS = dict(moe_capacity_factor=1.0, moe_drop_policy="position")
PAD = dict(moe_capacity_factor=1.0, moe_pad_to_capacity=True)


def _train(**overrides) -> dict | None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _check(result: dict | None, exact: bool = True) -> None:
    if rank() != 0:
        assert result is None
        return
    parity = result["parity"]
    assert parity["passed"], parity
    if exact:
        assert parity["max_moe_load_rel_diff"] == 0.0, parity
    cfg = result["config"]
    pairs = cfg["batch_size"] * cfg["seq_len"] * 2  # top-2
    steps = result["moe_load_counts"]
    assert len(steps) == SMALL["steps"]
    dropped = 0.0
    for step in steps:  # per layer: the E loads (every routed pair once), then the dropped pairs
        assert step and all(len(row) == cfg["experts"] + 1 and sum(row[:-1]) == pairs for row in step), step
        dropped += sum(row[-1] for row in step)
    assert 0 < dropped < pairs * len(steps), steps  # the capacity dropped some pairs, not all


LAYOUTS = {
    "moe: ep=2 borrowed from tp=2 x dp=2 (tokens replicated over tp), probs": dict(model="moe", ep=2, **CAP),
    "mla: tp=2 (SP) x dp=2, ep=2 (tp sequence blocks are groups), position, padded": dict(
        model="mla", ep=2, sequence_parallel=True, **POS, moe_pad_to_capacity=True
    ),
    "moe: pp=2 x dp_shard=2, 2 microbatches, position": dict(
        model="moe", pp=2, tp=1, dp_shard=2, microbatches=2, **POS
    ),
    "moe: cp_ring=2 (zigzag) x dp=2, ep=2, position, padded": dict(
        model="moe", tp=1, cp_ring=2, ep=2, **POS, moe_pad_to_capacity=True
    ),
    "moe: cp_ring=2 (stripe) x dp=2, probs": dict(model="moe", tp=1, cp_ring=2, cp_layout="stripe", **CAP),
    "moe: cp_ulysses=2 x dp=2, ep=4, padded": dict(model="moe", tp=1, cp_ulysses=2, ep=4, **PAD),
    "moe: dp=4, full activation checkpointing, padded": dict(model="moe", tp=1, ac="full", **PAD),
    "moe: tp=2 x dp=2, tensor-parallel experts (ep=1), position": dict(model="moe", **POS),
    "moe: dp=4, 2 microbatches of gradient accumulation, with the bias": dict(
        model="moe", tp=1, batch_size=8, microbatches=2, moe_bias_update_rate=0.05, **POS
    ),
}
QUICK = (
    # the replicated-token dispatch (capacity before the tp split), drop + pad in the dispatcher
    "moe: ep=2 borrowed from tp=2 x dp=2 (tokens replicated over tp), probs",
    # sequence blocks as groups, position order, padding over ep
    "mla: tp=2 (SP) x dp=2, ep=2 (tp sequence blocks are groups), position, padded",
    # microbatches as groups across stages
    "moe: pp=2 x dp_shard=2, 2 microbatches, position",
    # a zigzag cp part in its local order as a group
    "moe: cp_ring=2 (zigzag) x dp=2, ep=2, position, padded",
)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("overrides", tiered(LAYOUTS, QUICK))
def test_capacity_matches_one_process(overrides):
    _check(_train(**overrides))
