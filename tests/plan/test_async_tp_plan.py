"""The planner's async TP (``StepOptions(async_tp=True)``, ``shardkit plan --async-tp``):

* the collective-matmul rings' rows equal the trainer's ledger of one ``--async-tp`` step
  (count, bytes sent and received of every tp row: the rings, the regathers, the synchronous
  collectives left), under every ``--ac`` and on the composed layouts whose blocks keep
  synchronous gathers (MoE blocks of tensor-parallel experts, MLA);
* the exposed time of a ring is ``(t - 1) max(0, c - m)`` with ``c`` one block's alpha-beta
  transfer and ``m`` one block's matmul, checked against numbers worked by hand, and a step's
  total moves by exactly that against the synchronous collectives it replaces.
"""

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank
from harness.ledger_run import ledger_of_a_run
from harness.tiny_lm import TINY_LLAMA_CONFIG as TINY
from shardkit import Cluster, ModelShape, ParallelDims, StepOptions, estimate_step
from shardkit.plan._tp_rings import Ring, rings_exposed_seconds, stage_rings
from shardkit.plan.collectives import ledger_table, merged, step_collectives
from shardkit.plan.options import rank_stage
from shardkit.plan.timing import tp_rings_exposed
from shardkit.train.config import TrainConfig, validate_config

CORPUS = SMALL_CORPUS
SMALL = dict(
    steps=1, seq_len=16, batch_size=4, dtype="float32", verify=False, layers=2, lr=1e-3, async_tp=True, data=CORPUS
)


def _tp(table: dict, t: int) -> dict:
    """Rows of groups of tp's size, but the expert exchanges (router-dependent bytes; held to the
    ledger by tests/plan/test_ledger.py)."""
    return {k: v for k, v in table.items() if k[3] == t and k[1] not in ("token_dispatch", "token_combine")}


def _check(overrides: dict) -> None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=torch.distributed.get_world_size())
    dims, shape, ledger = ledger_of_a_run(cfg)
    opts = StepOptions(
        cfg.seq_len,
        cfg.batch_size,
        cfg.microbatches,
        cfg.dtype,
        cfg.sequence_parallel,
        cfg.loss_parallel,
        activation_checkpoint=cfg.ac,
        async_tp=True,
    )
    stage, tp_rank = rank_stage(dims, rank())
    got = ledger_table(ledger.records)
    want = merged(step_collectives(shape, dims, opts, stage, tp_rank))
    if cfg.ac != "none":  # the planner leaves out a checkpointed block's synchronous recompute collectives
        got = {k: v for k, v in got.items() if k[2] != "recompute" or k[0] in ("send", "recv") or k[1] == "sp_regather"}
        got = {k: v for k, v in got.items() if not (k[1] == "all_gather" and k[2] == "recompute")}
        want = {k: v for k, v in want.items() if not (k[1] == "all_gather" and k[2] == "recompute")}
    t = dims.tp
    got, want = _tp(got, t), _tp(want, t)
    rings = {k for k in got if k[0] in ("send", "recv")}
    assert rings, got
    diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
    assert not diff, f"(ledger, plan) differ at {diff}"


@pytest.mark.world(2, timeout=180)
@pytest.mark.combinations
@pytest.mark.parametrize("ac", ["none", "full", "selective", "selective:2"])
def test_ring_rows_equal_the_ledger_tp2(ac):
    _check(dict(tp=2, ac=ac))


@pytest.mark.world(4, timeout=240)
@pytest.mark.combinations
@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=4, kv_heads=4),
        dict(model="mla", sequence_parallel=True),  # tensor-parallel and shared experts: synchronous MoE gather
        dict(model="mla", ep=2, sequence_parallel=True),  # shared experts' gather ring beside expert dispatch
        dict(pp=2, tp=2, microbatches=2),
    ],
    ids=["tp4", "mla-tp-experts", "mla-ep2-shared", "pp2"],
)
def test_ring_rows_equal_the_ledger_composed(layout):
    _check(layout)


def test_ring_exposure_by_hand():
    """t = 4: a ring of step transfer 3 s and block matmul 1 s leaves 3 x 2 s; one of matmul
    5 s leaves nothing; counts multiply."""
    rings = [Ring("all_gather_matmul", "forward", 2, 1e12), Ring("matmul_reduce_scatter", "forward", 1, 5e12)]
    assert rings_exposed_seconds(rings, 4, 3.0, 1e12) == pytest.approx(2 * 3 * 2.0)


@pytest.mark.parametrize("gbps,tflops", [(0.05, 1.0), (450.0, 0.001)])
def test_step_time_moves_by_the_ring_exposure(gbps, tflops):
    """The same layout with and without async TP: the step differs by the synchronous tp
    collectives' seconds the rings replace (the gathers, reduce-scatters and regathers), less
    what the rings leave exposed, which is (t - 1) max(0, c - m) summed over the stage's rings
    (slow links: exposed; slow matmuls: none)."""
    shape = ModelShape.from_config(TINY)
    dims = ParallelDims(tp=4, dp_replicate=2)
    cluster = Cluster(gpus=8, intra_gbps=gbps, peak_tflops=tflops)
    opts = StepOptions(seq_len=64, global_batch=8, microbatches=2, dtype="float32")
    sync = estimate_step(shape, dims, opts, cluster)
    ring = estimate_step(shape, dims, StepOptions(**{**opts.__dict__, "async_tp": True}), cluster)
    exposed = tp_rings_exposed(shape, dims, ring.options, cluster, 0)
    T = 8 // 2 // 2 * 64
    rings = stage_rings(shape, ring.options, list(range(shape.layers)), True, T, 2, 4, 1)
    step = T // 4 * shape.hidden * 4 / (gbps * 1e9) + 3e-6
    rate = tflops * 1e12 * cluster.efficiency
    assert exposed == pytest.approx(sum(r.calls * 3 * max(0.0, step - r.flops / rate) for r in rings))
    assert (exposed > 0) == (gbps < 1)
    gone = sum(s for r, s in sync.rows if r.axis == "tp" and r.api in ("all_gather", "reduce_scatter", "sp_regather"))
    assert ring.step_s == pytest.approx(sync.step_s - gone + exposed, rel=1e-9)


def test_plan_cli_async_tp_ranks_with_the_rings(tmp_path, capsys):
    """``shardkit plan --async-tp``: the same layout (tp 4, SP) predicted with the rings' exposure
    instead of the synchronous collectives: a shorter step (each ring step's matmul hides part of
    its transfer), and the search's best step is never slower than without the flag."""
    import json

    from shardkit.cli.main import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    base = ["plan", "--config", str(config), "--gpus", "8", "--seq-len", "64", "--global-batch", "8", "--json"]
    base += ["--compare", "tp=4,dp_replicate=2", "--top", "3"]
    rows = {}
    for flag in ([], ["--async-tp"]):
        assert main(base + flag) == 0
        rows[bool(flag)] = json.loads(capsys.readouterr().out)
    given = {k: next(r for r in v if r["given"]) for k, v in rows.items()}
    assert given[True]["step_s"] < given[False]["step_s"]
    assert min(r["step_s"] for r in rows[True]) <= min(r["step_s"] for r in rows[False])
