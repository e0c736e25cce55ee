"""``shardkit train``'s MoE balancing flags (issue 34 item 2): ``--moe-bias-update-rate``,
``--moe-z-loss``, ``--moe-seq-aux-loss`` against the one-process reference (``--verify``).

Each case trains 2 steps in float64 and checks on rank 0 that the losses, gradient norms and final
parameters match the reference (which runs the same balanced routers on the whole batch), and
that the per-step expert load the parallel run all-reduced equals the reference's load over the
whole batch exactly (``max_moe_load_rel_diff == 0``). The bias rate is large enough (0.05 against
routing probabilities near 1 / E = 0.25) that the step-1 bias changes step 2's top-k selection,
so a bias missing or stepped differently on any rank shows in step 2's load and loss.
"""

import time

import pytest
import torch

from harness.helpers import rank, world_size
from harness.tiers import tiered
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3)
ALL = dict(moe_bias_update_rate=0.05, moe_z_loss=1e-2, moe_seq_aux_loss=1e-2)
NO_SEQ = dict(moe_bias_update_rate=0.05, moe_z_loss=1e-2)


def _train(**overrides) -> dict | None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _check(result: dict | None, top_k: int = 2) -> None:
    if rank() != 0:
        assert result is None
        return
    parity = result["parity"]
    assert parity["passed"], parity
    assert parity["max_moe_load_rel_diff"] == 0.0, parity
    cfg = result["config"]
    loads = result["moe_load_counts"]
    assert len(loads) == SMALL["steps"]
    pairs = cfg["batch_size"] * cfg["seq_len"] * top_k
    for step in loads:  # every MoE layer counted every (token, slot) pair of the global batch once
        assert step and all(sum(layer) == pairs for layer in step), step


LAYOUTS = {
    "moe: ep=2 borrowed from tp=2 x dp=2 (tokens replicated over tp)": dict(model="moe", ep=2, **ALL),
    "mla: tp=2 (SP) x dp=2, ep=2": dict(model="mla", ep=2, sequence_parallel=True, **NO_SEQ),
    "moe: pp=2 x dp_shard=2, 2 microbatches": dict(model="moe", pp=2, tp=1, dp_shard=2, microbatches=2, **ALL),
    "moe: cp_ring=2 x dp=2, ep=2": dict(model="moe", tp=1, cp_ring=2, ep=2, **NO_SEQ),
    "moe: dp=4, full activation checkpointing": dict(model="moe", tp=1, ac="full", **ALL),
    "moe: dp=4, bias only": dict(model="moe", tp=1, moe_bias_update_rate=0.05),
}
QUICK = (
    "moe: ep=2 borrowed from tp=2 x dp=2 (tokens replicated over tp)",
    "mla: tp=2 (SP) x dp=2, ep=2",
    "moe: pp=2 x dp_shard=2, 2 microbatches",
    "moe: dp=4, full activation checkpointing",
)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("overrides", tiered(LAYOUTS, QUICK))
def test_moe_balancing_matches_one_process(overrides):
    _check(_train(**overrides))
