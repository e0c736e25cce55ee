"""The chunked runner with static ``boundary_shapes`` and under the check mode, on one-chunk
stages (:class:`PipelineStage`) and on chunked ones, against one process's backprop.

Every rank builds the full float64 MLP from one seed and keeps its chunks; losses (the rank
holding the last chunk) and every kept parameter's gradient must match the mean-loss backprop
(1e-12). The ledger proves the form of each message: static shapes send one message per
hand-over between ranks (no header); the check mode sends a header with every message on every
call (nothing cached) and agrees on the table at every call.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from harness.pipe_models import mse, tanh_mlp
from shardkit.comm import CommLedger, checks
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import PipelineStage, chunk_layers, run_schedule
from shardkit.pipeline_parallel.simulate import transfers
from shardkit.pipeline_parallel.tables import SCHEDULES, schedule_table

H, LAYERS, MB, S = 4, 8, 2, 3
CASES = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2)]


def _model():
    return tanh_mlp(H, LAYERS, seed=2024)


def _stage(full, name, v, g):
    """This rank's stage: PipelineStage(module, g, r, p) for one chunk per rank, else of its chunks."""
    r, p = rank(), world_size()
    placement = SCHEDULES[name].placement
    chunks = [
        copy.deepcopy(nn.Sequential(*list(full)[2 * k.start : 2 * k.stop]))
        for k in chunk_layers(LAYERS, p, v, placement, r)
    ]
    if v == 1:
        return PipelineStage(chunks[0], g, r, p, loss_fn=mse if r == p - 1 else None), chunks
    return PipelineStage(chunks, g, placement=placement, loss_fn=mse), chunks


def _data(m):
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(MB, S, H, generator=gen, dtype=torch.float64) for _ in range(m)]
    ts = [torch.randn(MB, S, H, generator=gen, dtype=torch.float64) for _ in range(m)]
    return xs, ts


def _check_parity(full, stage, chunks, losses, xs, ts, name, v):
    r, p = rank(), world_size()
    full.zero_grad()
    ref = [mse(full(x), t) for x, t in zip(xs, ts)]
    (sum(ref) / len(xs)).backward()
    ok = True
    if stage.holds(p * v - 1):
        ok &= len(losses) == len(xs) and all(torch.allclose(a, b.detach(), rtol=1e-12) for a, b in zip(losses, ref))
    kept = [k for k in chunk_layers(LAYERS, p, v, SCHEDULES[name].placement, r)]
    for mod, k in zip(chunks, kept, strict=True):
        refs = nn.Sequential(*list(full)[2 * k.start : 2 * k.stop]).parameters()
        for a, b in zip(mod.parameters(), refs, strict=True):
            ok &= a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    return ok


def _hand_overs(name, v, m):
    """(sends, receives) of this rank between ranks in one call (local hand-overs excluded)."""
    r, p = rank(), world_size()
    table = schedule_table(name, p, v, m)
    sent = transfers(table, placement=SCHEDULES[name].placement, v=v)[0]
    mine = sum(len(msgs) for (src, dst), msgs in sent.items() if src == r and dst != r)
    theirs = sum(len(msgs) for (src, dst), msgs in sent.items() if dst == r and src != r)
    return mine, theirs


@pytest.mark.world(2, timeout=60)
@pytest.mark.parametrize(("name", "v"), CASES)
def test_static_boundary_shapes_match_backprop_with_one_message_per_hand_over(name, v):
    p, m = world_size(), 4
    full = _model()
    stage, chunks = _stage(full, name, v, world_group())
    xs, ts = _data(m)
    shapes = [((MB, S, H), torch.float64)] * (p * v - 1)
    with CommLedger() as ledger:
        losses = run_schedule(stage, name, xs, ts, num_microbatches=m, boundary_shapes=shapes)
    ok = _check_parity(full, stage, chunks, losses, xs, ts, name, v)
    sends, recvs = _hand_overs(name, v, m)
    ok &= ledger.count(op="send") == sends and ledger.count(op="recv") == recvs
    assert all_true(ok), (name, v, ledger.count(op="send"), sends, ledger.count(op="recv"), recvs)


@pytest.mark.world(2, timeout=60)
@pytest.mark.parametrize(("name", "v"), CASES)
def test_check_mode_runs_with_a_header_on_every_message_and_agrees_every_call(name, v):
    """Two calls under checks: both read a header before each payload (a repeated shape is not
    trusted) and both agree on the table (one all-reduce each); the second call's gradients are
    twice the reference's (accumulated)."""
    p, m = world_size(), 4
    full = _model()
    stage, chunks = _stage(full, name, v, world_group())
    xs, ts = _data(m)
    static = name in ("1f1b", "zbv")  # static shapes under checks: a header too, counted as "check"
    kw = dict(boundary_shapes=[((MB, S, H), torch.float64)] * (p * v - 1)) if static else {}
    counts = []
    with checks(True):
        for _ in range(2):
            with CommLedger() as ledger:
                losses = run_schedule(stage, name, xs, ts, num_microbatches=m, **kw)
            counts.append((ledger.count(op="send"), ledger.count(op="recv"), ledger.count(op="all_reduce")))
    for mod in chunks:
        for q in mod.parameters():
            q.grad /= 2
    ok = _check_parity(full, stage, chunks, losses, xs, ts, name, v)
    sends, recvs = _hand_overs(name, v, m)
    ok &= counts == [(2 * sends, 2 * recvs, 1)] * 2
    assert all_true(ok), (name, v, counts, sends, recvs)


@pytest.mark.world(2, timeout=60)
def test_boundary_shapes_that_differ_between_ranks_raise_on_every_rank():
    r, p = rank(), world_size()
    stage, _ = _stage(_model(), "1f1b", 1, world_group())
    xs, ts = _data(2)
    dtype = torch.float32 if r == 1 else torch.float64
    with pytest.raises(ShardkitError, match=r"ranks \[1\] passed boundary_shapes"):
        run_schedule(stage, "1f1b", xs, ts, num_microbatches=2, boundary_shapes=[((MB, S, H), dtype)])
    with pytest.raises(ShardkitError, match=r"boundary_shapes must be 1 pairs"):
        run_schedule(stage, "1f1b", xs, ts, num_microbatches=2, boundary_shapes=[((MB, S, H), torch.float64)] * 2)
    losses = run_schedule(stage, "1f1b", xs, ts, num_microbatches=2)  # nothing stale: runs on
    assert all_true(r != p - 1 or len(losses) == 2)


@pytest.mark.world(2, timeout=60)
def test_check_mode_tensor_off_its_declared_shape_raises_on_both_ends():
    """Checks on: the first stage's output is not the declared boundary shape; its header says so,
    so the sender and the receiver both raise (no hang). A group of its own: the failed call
    leaves posted receives behind."""
    r = rank()
    g = dist.new_group([0, 1])
    stage, _ = _stage(_model(), "gpipe", 1, g)
    xs, ts = _data(2)
    with checks(True), pytest.raises(ShardkitError) as info:
        run_schedule(stage, "gpipe", xs, ts, num_microbatches=2, boundary_shapes=[((MB, S + 1, H), torch.float64)])
    text = str(info.value)
    want = "but its tensor is" if r == 0 else "reported that its tensor does not match its own declared static"
    assert all_true(want in text), text
