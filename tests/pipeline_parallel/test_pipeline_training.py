"""Pipeline training parity: GPipe and 1F1B on pp in {2, 3, 4} against one process.

Every rank builds the full float64 model from the same seed, runs its slice as a pipeline stage
and compares the loss (last stage) and its slice's parameter gradients with the reference's
(rtol 1e-9). Microbatches are ``[B / M, S_i, H]`` with a different ``S_i`` each (a per-token
MLP), so the shape negotiation of every transfer is exercised.
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from harness.pipe_models import mse, tanh_mlp
from shardkit.comm import CommLedger
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import (
    PipelineStage,
    gpipe_schedule,
    one_f_one_b_schedule,
    run_schedule,
    split_microbatches,
)

H, LAYERS = 5, 6
SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def _model():
    return tanh_mlp(H, LAYERS, seed=1234)


def _slice(model, s, P):
    """Balanced split of the LAYERS (Linear, Tanh) pairs: the first LAYERS % P stages get one more."""
    sizes = [LAYERS // P + (i < LAYERS % P) for i in range(P)]
    start = sum(sizes[:s])
    return nn.Sequential(*list(model)[2 * start : 2 * (start + sizes[s])])


def _data(M, varlen, mb=2):
    gen = torch.Generator().manual_seed(99)
    lens = [3 + (2 * m if varlen else 0) for m in range(M)]
    xs = [torch.randn(mb, S, H, generator=gen, dtype=torch.float64) for S in lens]
    ts = [torch.randn(mb, S, H, generator=gen, dtype=torch.float64) for S in lens]
    return xs, ts


def _reference(model, xs, ts):
    model.zero_grad()
    losses = [mse(model(x), t) for x, t in zip(xs, ts)]
    (sum(losses) / len(losses)).backward()
    return [loss.detach() for loss in losses]


def _parity(schedule_name, M, varlen):
    s, P, g = rank(), world_size(), world_group()
    full = _model()
    xs, ts = _data(M, varlen)
    ref_losses = _reference(full, xs, ts)
    module = copy.deepcopy(_slice(full, s, P))
    module.zero_grad()
    stage = PipelineStage(module, g, s, P, loss_fn=mse if s == P - 1 else None)
    losses = run_schedule(stage, SCHEDULES[schedule_name](P, M), xs if s == 0 else None, ts if s == P - 1 else None)
    ok = True
    if s == P - 1:
        ok &= len(losses) == M and all(torch.allclose(a, b, rtol=1e-9, atol=0) for a, b in zip(losses, ref_losses))
    else:
        ok &= losses is None
    ref_params = list(_slice(full, s, P).parameters())
    for p, r in zip(module.parameters(), ref_params, strict=True):
        ok &= p.grad is not None and torch.allclose(p.grad, r.grad, rtol=1e-9, atol=1e-15)
    assert all_true(ok)


_CASES = [pytest.mark.parametrize("schedule_name", sorted(SCHEDULES)), pytest.mark.parametrize("M", [1, 3, 4])]


def _params(fn):
    for mark in reversed(_CASES):
        fn = mark(fn)
    return fn


@pytest.mark.world(2, timeout=30)
@_params
def test_parity_pp2(schedule_name, M):
    _parity(schedule_name, M, varlen=False)


@pytest.mark.world(3, timeout=30)
@_params
def test_parity_pp3_varlen(schedule_name, M):
    _parity(schedule_name, M, varlen=True)


@pytest.mark.world(4, timeout=30)
@_params
def test_parity_pp4_varlen(schedule_name, M):
    _parity(schedule_name, M, varlen=True)


@pytest.mark.world(2, timeout=30)
@pytest.mark.parametrize("schedule_name", sorted(SCHEDULES))
def test_parity_pp2_varlen_and_split_batch(schedule_name):
    _parity(schedule_name, 4, varlen=True)
    # split_microbatches: the full batch's mean loss and gradients equal the pipeline's.
    s, P, g = rank(), world_size(), world_group()
    full = _model()
    gen = torch.Generator().manual_seed(5)
    x, t = (
        torch.randn(6, 4, H, generator=gen, dtype=torch.float64),
        torch.randn(6, 4, H, generator=gen, dtype=torch.float64),
    )
    full.zero_grad()
    ref = mse(full(x), t)
    ref.backward()
    module = copy.deepcopy(_slice(full, s, P))
    module.zero_grad()
    stage = PipelineStage(module, g, s, P, loss_fn=mse)
    losses = run_schedule(stage, SCHEDULES[schedule_name](P, 3), split_microbatches(x, 3), split_microbatches(t, 3))
    ok = s < P - 1 or torch.allclose(torch.stack(losses).mean(), ref.detach(), rtol=1e-9)
    for p, r in zip(module.parameters(), _slice(full, s, P).parameters(), strict=True):
        ok &= torch.allclose(p.grad, r.grad, rtol=1e-9, atol=1e-15)
    assert all_true(ok)


@pytest.mark.world(3, timeout=30)
@pytest.mark.parametrize("schedule_name", sorted(SCHEDULES))
def test_ledger_counts_exactly_the_planned_transfers(schedule_name):
    """Each transfer the table implies is a header and a payload (negotiated shapes: every
    microbatch has another sequence length, so no cached shape is reused), one send and one
    receive per hand-over under the chunked runner's API names; nothing else is sent but the
    argument agreement's one all-reduce."""
    s, P, g = rank(), world_size(), world_group()
    M, table = 4, SCHEDULES[schedule_name](P, 4)
    xs, ts = _data(M, varlen=True)
    stage = PipelineStage(copy.deepcopy(_slice(_model(), s, P)), g, s, P, loss_fn=mse)
    with CommLedger() as ledger:
        run_schedule(stage, table, xs, ts)
    expected = {}
    for kind, _ in table[s]:
        phase = "forward" if kind == "F" else "backward"
        # F: the activation from the previous stage and to the next; B: the gradients back
        recv, send = (s > 0, s < P - 1) if kind == "F" else (s < P - 1, s > 0)
        for api, on in ((f"recv_{phase}", recv), (f"send_{phase}", send)):
            if on:
                expected[(api, phase)] = expected.get((api, phase), 0) + 2
    ok = sum(expected.values()) == 4 * M * ((s > 0) + (s < P - 1))
    expected[("run_schedule", "check")] = 1  # the argument agreement: one small all-reduce
    got = {(r.api, r.phase): ledger.count(api=r.api, phase=r.phase) for r in ledger.records}
    ok &= got == expected and ledger.count(op="all_reduce", api="run_schedule", group_size=P) == 1
    assert all_true(ok), (got, expected)


@pytest.mark.world(3, timeout=30)
def test_negotiated_shapes_are_kept_across_calls_of_one_stage():
    """A stage's second call with the same microbatch shapes sends one message per transfer (the
    header packed with the payload: no negotiation left); a third call with other shapes
    negotiates again; every call's losses and gradients match the single-process reference."""
    s, P, g = rank(), world_size(), world_group()
    full = _model()
    module = copy.deepcopy(_slice(full, s, P))
    stage = PipelineStage(module, g, s, P, loss_fn=mse)
    table = one_f_one_b_schedule(P, 3)
    # transfers of this stage: each F receives (s > 0) and sends (s < P - 1), each B the reverse
    planned = sum((s > 0) + (s < P - 1) for _ in table[s])
    ok, counts = True, []
    for varlen in (False, False, True):
        xs, ts = _data(3, varlen)
        ref_losses = _reference(full, xs, ts)
        module.zero_grad()
        with CommLedger() as ledger:
            losses = run_schedule(stage, table, xs, ts)
        counts.append(len(ledger.records))
        if s == P - 1:
            ok &= all(torch.allclose(a, b, rtol=1e-9, atol=0) for a, b in zip(losses, ref_losses))
        for p, r in zip(module.parameters(), _slice(full, s, P).parameters(), strict=True):
            ok &= torch.allclose(p.grad, r.grad, rtol=1e-9, atol=1e-15)
    # First call: each channel's first transfer negotiates (2 messages); second: 1 each; third:
    # microbatch 0 keeps the cached shape (1 message), the others change it (a dummy of the
    # cached shape, then the payload: 2). The first call also agrees on its arguments (one
    # all-reduce); later calls of the same table skip it with checks off (issue 29).
    channels = (s > 0) * 2 + (s < P - 1) * 2
    ok &= counts == [planned + channels + 1, planned, 2 * planned - channels]
    assert all_true(ok), counts


# ---------------------------------------------------------------- bad inputs: every rank raises


def _raises_everywhere(fragment, fn):
    with pytest.raises(ShardkitError, match=fragment) as info:
        fn()
    return str(info.value)


@pytest.mark.world(3, timeout=20)
def test_split_microbatches_not_dividing_raises():
    _raises_everywhere("3 microbatches do not divide the batch of 4", lambda: split_microbatches(torch.zeros(4, 2), 3))
    _raises_everywhere("must be an int >= 1", lambda: split_microbatches(torch.zeros(4, 2), 0))


@pytest.mark.world(3, timeout=20)
def test_stage_index_not_group_rank_raises_on_every_rank():
    s, P, g = rank(), world_size(), world_group()
    wrong = (s + 1) % P if s == 1 else s  # only rank 1 is wrong
    msg = _raises_everywhere(
        "rank 1: stage_index=2 but this rank is group rank 1",
        lambda: PipelineStage(nn.Identity(), g, wrong, P, loss_fn=mse),
    )
    assert "1 of 3 pipeline ranks" in msg


@pytest.mark.world(3, timeout=20)
def test_num_stages_not_group_size_raises_on_every_rank():
    s, g = rank(), world_group()
    _raises_everywhere(
        "num_stages=2 but the pipeline group has 3 ranks", lambda: PipelineStage(nn.Identity(), g, s, 2, loss_fn=mse)
    )


@pytest.mark.world(2, timeout=20)
def test_last_stage_without_loss_raises_on_every_rank():
    s, P, g = rank(), world_size(), world_group()
    _raises_everywhere("rank 1: the last stage .1. needs loss_fn", lambda: PipelineStage(nn.Identity(), g, s, P))


@pytest.mark.world(3, timeout=20)
def test_bad_run_arguments_raise_on_every_rank():
    s, P, g = rank(), world_size(), world_group()
    stage = PipelineStage(nn.Identity(), g, s, P, loss_fn=mse)
    xs = [torch.zeros(1, 2)] * 3
    # The first stage got 2 inputs for a 3-microbatch schedule: agreed, so no rank hangs.
    _raises_everywhere(
        "rank 0: rank 0 holds chunk 0 and needs 3 inputs_microbatches .the schedule's M., got 2",
        lambda: run_schedule(stage, gpipe_schedule(P, 3), xs[:2], xs),
    )
    # Pure checks of the table raise identically on every rank without communicating.
    _raises_everywhere(
        "the table has 2 rows, the pipeline 3 ranks", lambda: run_schedule(stage, gpipe_schedule(2, 3), xs, xs)
    )
    bad = gpipe_schedule(P, 2)
    # rank 1 backwards before its forwards: a gradient it waits for needs its own activation
    swapped = (bad[0], bad[1][2:] + bad[1][:2], bad[2])
    _raises_everywhere("the table cannot run on 3 ranks", lambda: run_schedule(stage, swapped, xs[:2], xs[:2]))
    # The stage still runs a step after the errors (nothing stale in the channels).
    losses = run_schedule(stage, one_f_one_b_schedule(P, 3), xs, xs)
    assert all_true(s < P - 1 or [float(loss) for loss in losses] == [0.0, 0.0, 0.0])
