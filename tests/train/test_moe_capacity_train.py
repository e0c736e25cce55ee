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

from harness.helpers import SMALL_CORPUS, rank, world_size
from harness.tiers import tiered
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3, data=CORPUS)
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
    "moe: tp=2 (SP) x dp=2, tensor-parallel experts (the block gathers the sequence), probs": dict(
        model="moe", sequence_parallel=True, **CAP
    ),
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


@pytest.mark.world(4, timeout=180)
def test_capacity_with_bf16_compute():
    # bf16 compute on float32 masters, the reference in bf16 too: a near-tie of two bf16 routing
    # weights may rank differently, so loads and drops agree to the bf16 tolerance, not exactly
    result = _train(model="moe", tp=1, ep=2, dtype="float32", mixed_precision="bf16", **PAD)
    if rank() == 0:
        assert result["parity"]["tolerance"] == 2e-2
    _check(result, exact=False)


def test_sequence_groups_follow_each_layout():
    from shardkit.train.moe_capacity import sequence_groups

    def groups(*args):
        return [g.tolist() for g in sequence_groups(8, *args)]

    assert groups(1, 1, "zigzag", 1) == [list(range(8))]
    assert groups(2, 1, "zigzag", 1) == [[0, 1, 6, 7], [2, 3, 4, 5]]  # chunks r and 2R - 1 - r
    assert groups(2, 1, "contiguous", 1) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(2, 1, "stripe", 1) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups(1, 2, "zigzag", 1) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # Ulysses: balanced blocks
    assert groups(2, 1, "zigzag", 2) == [[0, 1], [6, 7], [2, 3], [4, 5]]  # sp blocks of each cp part
    assert groups(1, 1, "zigzag", 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # uneven: balanced sizes


def test_reference_groups_cut_rows_per_data_rank_and_microbatch():
    from shardkit.train.moe_capacity import reference_groups

    # dp=4 (world 4, tp=1), 2 microbatches, B=16: groups of 2 rows; with cp the positions too
    cfg = validate_config(TrainConfig(model="moe", tp=1, batch_size=16, microbatches=2, seq_len=4), world_size=4)
    got = [g.tolist() for g in reference_groups(cfg)(8 * 4)]  # the reference's microbatch: 8 rows
    assert got == [list(range(8 * i, 8 * i + 8)) for i in range(4)]
    cfg = validate_config(TrainConfig(model="moe", tp=1, cp_ring=2, batch_size=4, seq_len=4), world_size=4)
    got = [g.tolist() for g in reference_groups(cfg)(4 * 4)]  # dp=2: 2 rows per group, zigzag halves
    assert got == [[0, 3, 4, 7], [1, 2, 5, 6], [8, 11, 12, 15], [9, 10, 13, 14]]
    from shardkit import ShardkitError

    with pytest.raises(ShardkitError, match="not whole groups"):
        reference_groups(cfg)(6)


def test_grouping_changes_what_drops():
    # why the reference needs the groups: the same routing kept per group of 4 tokens (each its
    # own capacity, 2 pairs per expert) and as one call of 8 (capacity 4) keeps different pairs
    from shardkit.expert_parallel.router_capacity import grouped_capacity_keep

    index = torch.tensor([[0], [0], [0], [0], [1], [1], [1], [1]])  # top-1 of 8 tokens, E = 2
    weights = torch.linspace(0.9, 0.1, 8)[:, None]
    whole = grouped_capacity_keep(index, weights, 2, 1.0)
    halves = grouped_capacity_keep(index, weights, 2, 1.0, groups=[torch.arange(4), torch.arange(4, 8)])
    assert whole.reshape(-1).tolist() == [True] * 8
    assert halves.reshape(-1).tolist() == [True, True, False, False, True, True, False, False]
    from shardkit import ShardkitError

    with pytest.raises(ShardkitError, match="each token must be in one group"):
        grouped_capacity_keep(index, weights, 2, 1.0, groups=[torch.arange(4), torch.arange(3, 8)])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(model="moe", moe_capacity_factor=0.0), "--moe-capacity-factor must be a finite number > 0"),
        (dict(model="moe", moe_capacity_factor=float("inf")), "--moe-capacity-factor must be a finite number > 0"),
        (dict(model="moe", moe_capacity_factor=1.0, moe_drop_policy="random"), "--moe-drop-policy must be one of"),
        (dict(model="moe", moe_pad_to_capacity=True), "--moe-pad-to-capacity needs --moe-capacity-factor"),
        (dict(model="llama", moe_capacity_factor=1.0), "--moe-capacity-factor: 'llama' has no routed experts"),
        (dict(model="moe", compile="aot_eager", moe_capacity_factor=1.0), "--moe-capacity-factor with --compile"),
        (
            dict(model="moe", tp=1, cp_ring=2, packed=True, moe_capacity_factor=1.0),
            "--moe-capacity-factor with --packed and context parallelism",
        ),
    ],
)
def test_bad_capacity_options_are_refused_before_launch(kwargs, match):
    from shardkit import ShardkitError
    from shardkit.train.config_file import merge_config

    with pytest.raises(ShardkitError, match=match):
        validate_config(merge_config({}, kwargs))


@pytest.mark.world(4, timeout=180)
def test_dropped_fraction_in_metrics_and_summary():
    import io
    import json
    import os

    from rich.console import Console

    from harness.helpers import remove_shared_dir, shared_tmpdir
    from shardkit.cli.report import print_summary

    report = shared_tmpdir("shardkit-moe-cap-report-")
    try:
        result = _train(model="moe", tp=1, verify=False, report=report, **CAP)
        if rank() == 0:
            lines = [json.loads(x) for x in open(os.path.join(report, "metrics.jsonl"))]
            assert [x["step"] for x in lines] == [1, 2]
            for line, step in zip(lines, result["moe_load_counts"]):
                assert line["moe_layers"] == [0, 1] and "moe_load_counts" not in line
                want = [row[-1] / sum(row[:-1]) for row in step]
                assert line["moe_dropped_fraction"] == want and 0 < sum(want) < 2
            out = io.StringIO()
            print_summary(result, Console(file=out, width=200))
            rows = [x for x in out.getvalue().splitlines() if "dropped (token, slot) pairs" in x]
            assert len(rows) == 1 and "capacity factor 1, probs" in rows[0], out.getvalue()
    finally:
        remove_shared_dir(report)
