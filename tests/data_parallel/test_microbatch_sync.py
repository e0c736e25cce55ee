"""FSDP2 and HSDP under pipelines and gradient accumulation gather and reduce once per step.

Each case runs the trainer (:func:`shardkit.train.run.train`, what ``shardkit train`` runs) for
two steps in float64 with ``--verify`` and counts, on every rank, the FSDP2 collectives of the
:class:`~shardkit.CommLedger` (api ``"fully_shard"``: shardkit's custom all-gather and
reduce-scatter, and HSDP's all-reduce hook). With ``M > 1`` microbatches, every FSDP2 parameter
group of a rank's model (stage) -- each decoder layer and the root -- is all-gathered once per
step, before the first forward, and its gradient is reduce-scattered (HSDP: and all-reduced over
``dp_replicate``) once per step; the losses, gradient norms and parameters still equal one
process's. One microbatch keeps FSDP2's default (gathered again for backward). Replicated data
parallelism (:class:`~shardkit.data_parallel.GradientSync`, no FSDP2) reduces once per step too.

Every count here is per-microbatch without :func:`~shardkit.data_parallel.set_microbatch` (the
``without_policy`` case checks that the counts do change when the policy is switched off).
"""

from __future__ import annotations

import time
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from harness.helpers import SMALL_CORPUS, get_mesh, rank, world_size
from harness.tiers import tiered
from shardkit import CommLedger
from shardkit.data_parallel import set_microbatch
from shardkit.data_parallel.microbatches import reduce_outside_autograd, set_group_sync
from shardkit.errors import ShardkitError
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
STEPS, LAYERS = 2, 2
SMALL = dict(steps=STEPS, seq_len=16, dtype="float64", verify=True, layers=LAYERS, lr=1e-3, tp=1, data=CORPUS)


def _run(overrides: dict) -> tuple[list[Counter], dict | None]:
    """Every rank's FSDP2 calls over the run, ``Counter((op, phase))``, and rank 0's result."""
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    with CommLedger() as ledger:
        result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    mine = Counter((r.op, r.phase) for r in ledger.records if r.api == "fully_shard")
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, mine)
    return everyone, result


def _groups(overrides: dict, r: int = 0) -> int:
    """FSDP2 parameter groups of world rank ``r``: its stage's decoder layers (stages split them
    evenly here) and the root, which holds parameters on every stage of one chunk per rank
    (the embedding or the head, or both) and on stage 0 alone under a V (it holds both ends)."""
    pp = overrides.get("pp", 1)
    stage = r // (world_size() // pp)  # the mesh's pp axis comes first
    root = stage == 0 or overrides.get("schedule") not in ("zbv", "dualpipev")
    return overrides.get("layers", LAYERS) // pp + root


def _check_parity(result: dict | None, counts: list[Counter]) -> None:
    """Rank 0: the run matched one process, and its report's ledger shows the counted calls."""
    if rank() != 0:
        return
    assert result is not None and result["parity"]["passed"], result and result["parity"]
    assert result["parity"]["tolerance"] == 1e-9
    report: Counter = Counter()
    for row in result["ledger"]:
        if row["api"] == "fully_shard":
            report[(row["op"], row["phase"])] += row["count"]
    assert report == counts[0], (dict(report), dict(counts[0]))


ONCE = {
    "pp=2 x dp_shard=2, 1f1b, 4 microbatches": dict(pp=2, dp_shard=2, microbatches=4, batch_size=8),
    "pp=2 x dp_shard=2, gpipe, 4 microbatches": dict(pp=2, dp_shard=2, microbatches=4, batch_size=8, schedule="gpipe"),
    "pp=2 x dp_shard=2, interleaved-1f1b on 2 chunks per rank": dict(
        pp=2, dp_shard=2, microbatches=4, batch_size=8, schedule="interleaved-1f1b", virtual_stages=2, layers=4
    ),
    "pp=2 x dp_shard=2, zbv (V, I/W split)": dict(
        pp=2, dp_shard=2, microbatches=4, batch_size=8, schedule="zbv", virtual_stages=2, layers=4
    ),
    "pp=2 x dp_shard=2, zb-h1 (I/W split)": dict(pp=2, dp_shard=2, microbatches=4, batch_size=8, schedule="zb-h1"),
    "HSDP dp_replicate=2 x dp_shard=2, 4 microbatches": dict(dp_shard=2, microbatches=4, batch_size=16),
    "dp_shard=4, 4 accumulated microbatches": dict(dp_shard=4, microbatches=4, batch_size=16),
}


# Quick tier (issue 32, item 4): one case per path that counts the gathers: set_microbatch on one
# chunk a rank (1f1b), the chunked runner with the I/W split (zbv), and no pipeline (HSDP). GPipe,
# interleaved 1F1B, ZB-H1 and dp_shard=4 take the same paths (5-8 s each at load 40).
ONCE_QUICK = (
    "pp=2 x dp_shard=2, 1f1b, 4 microbatches",
    "pp=2 x dp_shard=2, zbv (V, I/W split)",
    "HSDP dp_replicate=2 x dp_shard=2, 4 microbatches",
)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("overrides", tiered(ONCE, ONCE_QUICK))
def test_fsdp_gathers_and_reduces_once_per_step(overrides):
    counts, result = _run(overrides)
    _check_parity(result, counts)
    hsdp = overrides.get("pp", 1) == 1 and overrides["dp_shard"] < world_size()
    for r, got in enumerate(counts):
        g = _groups(overrides, r) * STEPS
        want = Counter({("all_gather_single", "forward"): g, ("reduce_scatter_single", "backward"): g})
        if hsdp:
            want[("all_reduce", "backward")] = g
        assert got == want, (r, dict(got), dict(want))


# Slow tier only (issue 32, item 4): an 8-rank world's run composing two paths the quick tier
# takes one by one in test_fsdp_gathers_and_reduces_once_per_step (HSDP's all-reduce once per
# step: the HSDP case; set_microbatch on one chunk a rank and the V with the I/W split: the 1f1b
# and zbv cases); it was the quick tier's slowest case of this file (6 s at load 20).
@pytest.mark.slow
@pytest.mark.world(8, timeout=300)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_hsdp_under_pipeline_gathers_and_reduces_once_per_step(schedule):
    # pp=2 x dp_replicate=2 x dp_shard=2: HSDP's all-reduce over dp_replicate once per step too,
    # on one chunk per rank and on a V of two chunks with the I/W split
    overrides = dict(pp=2, dp_shard=2, microbatches=4, batch_size=16, schedule=schedule)
    if schedule == "zbv":
        overrides.update(virtual_stages=2, layers=4)
    counts, result = _run(overrides)
    _check_parity(result, counts)
    for r, got in enumerate(counts):
        g = _groups(overrides, r) * STEPS
        want = Counter(
            {
                ("all_gather_single", "forward"): g,
                ("reduce_scatter_single", "backward"): g,
                ("all_reduce", "backward"): g,
            }
        )
        assert got == want, (r, dict(got), dict(want))


# Quick tier: 1f1b (switching the policy off changes the counts: one case proves it; the chunked
# runner's FsdpSteps is the same object under interleaved 1F1B, which CI runs too)
WITHOUT_POLICY = ("pp=2 x dp_shard=2, 1f1b, 4 microbatches", "pp=2 x dp_shard=2, interleaved-1f1b on 2 chunks per rank")


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("name", tiered({n: n for n in WITHOUT_POLICY}, WITHOUT_POLICY[:1]))
def test_fsdp_without_policy_gathers_per_microbatch(name):
    # The counts above come from the one runner's FsdpSteps (every schedule, one chunk per rank
    # too): switched off, the same pipelined run gathers every layer for each forward and
    # backward and reduces after each backward.
    overrides = ONCE[name]
    with (
        mock.patch("shardkit.train.trainer.set_microbatch"),
        mock.patch("shardkit.pipeline_parallel._chunk_exec.fsdp_steps", return_value=None),
    ):
        counts, result = _run(overrides)
    _check_parity(result, counts)
    layers = overrides.get("layers", LAYERS) // 2
    for r, got in enumerate(counts):
        assert got[("reduce_scatter_single", "backward")] == 4 * _groups(overrides, r) * STEPS  # M x groups x steps
        assert got[("all_gather_single", "backward")] >= 4 * layers * STEPS  # each layer, before each backward


@pytest.mark.world(4, timeout=240)
def test_one_microbatch_keeps_fsdp_resharding():
    # ZeRO-3 memory when no microbatch reuses the gathered layers: gathered again for backward.
    counts, result = _run(dict(dp_shard=4, batch_size=4))
    _check_parity(result, counts)
    for got in counts:
        assert got[("all_gather_single", "forward")] == (LAYERS + 1) * STEPS
        assert got[("all_gather_single", "backward")] == LAYERS * STEPS
        assert got[("reduce_scatter_single", "backward")] == (LAYERS + 1) * STEPS


@pytest.mark.world(4, timeout=240)
def test_replicated_dp_reduces_once_per_step():
    # GradientSync (no FSDP2): one bucketed all-reduce per dtype and step, after the last microbatch.
    cfg = validate_config(TrainConfig(**{**SMALL, "microbatches": 4, "batch_size": 16}), world_size=world_size())
    with CommLedger() as ledger:
        result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    _check_parity(result, [Counter()])  # no FSDP2 call in rank 0's report either
    assert ledger.count(op="all_reduce", api="dp_cp_grads") == STEPS
    assert ledger.count(api="fully_shard") == 0
    if rank() == 0:  # the report's ledger shows the same one reduction per step
        rows = [r for r in result["ledger"] if r["api"] == "dp_cp_grads"]
        assert [(r["op"], r["axis"], r["count"]) for r in rows] == [("all_reduce", "dp_replicate", STEPS)], rows


@pytest.mark.parametrize("index,count", [(0, 0), (4, 4), (-1, 4), (0, True), (1.0, 2)])
def test_set_microbatch_rejects_bad_positions(index, count):
    with pytest.raises(ShardkitError, match="set_microbatch"):
        set_microbatch(torch.nn.Linear(2, 2), index, count)


@pytest.mark.world(2, timeout=60)
def test_reduce_outside_autograd_reduces_what_w_added_after_the_backward():
    """The one private FSDP2 name shardkit uses (FSDP2's end-of-backward callback, behind
    reduce_outside_autograd): a gradient added into ``.grad`` after the backward, as the
    zero-bubble W adds it, is reduced (the mean over the ranks) when it is called, not before.
    Fails if torch renames or changes the callback."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    mod = fully_shard(torch.nn.Linear(4, 4, bias=False, dtype=torch.float64), mesh=get_mesh((2,), ("dp",)))
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    extras = [torch.full((4, 4), float(r + 1), dtype=torch.float64) for r in range(2)]
    set_group_sync(mod, False)
    mod(xs[rank()]).sum().backward()  # sync off: the gradient stays unsharded, unreduced
    assert not isinstance(mod.weight, DTensor) and mod.weight.grad is not None
    mod.weight.grad.add_(extras[rank()])  # what W adds after its autograd pass
    set_group_sync(mod, True)
    reduce_outside_autograd(mod)
    assert isinstance(mod.weight, DTensor)  # resharded, its gradient reduced
    want = sum(x.sum(0).expand(4, 4) + e for x, e in zip(xs, extras)) / 2
    got = mod.weight.grad.full_tensor()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got, want)
