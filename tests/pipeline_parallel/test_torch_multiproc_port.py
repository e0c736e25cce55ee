"""Cases of PyTorch's ``test/distributed/pipelining/test_schedule_multiproc.py`` that shardkit can
express, ported onto its runner (our code; facts carried over: world 4, ``M = 4`` microbatches,
two stages per rank for the multi-stage schedules, ``scale_grads=False``, a sum-reduced MSE loss).

* ``test_eval_inference_mode`` (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble:
  ``interleaved-zb``; also ZB-H1, ZBV and DualPipeV, shardkit's other I/W tables): an eval
  call, rank 0 also under ``torch.no_grad()``; no parameter gets a gradient and the last stage has
  its losses. Here also: each loss bitwise equal to one process's forward, no gradient message.
* ``test_return_output``: a training call without ``return_outputs`` returns no outputs (here:
  the losses alone, not a :class:`~shardkit.pipeline_parallel.run_mode.ScheduleOutput`).
* ``test_v_shape_schedules`` (ZBV, DualPipeV; 8 stages on 4 ranks, 8 microbatches): the output
  equals the reference model's, the summed losses its loss, and the gradients its gradients.
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from shardkit.comm import CommLedger
from shardkit.pipeline_parallel import PipelineStage, chunk_layers, run_schedule
from shardkit.pipeline_parallel.run_mode import ScheduleOutput
from shardkit.pipeline_parallel.tables import SCHEDULES

D_HID, BATCH = 8, 16  # each microbatch [BATCH / M, D_HID]
# (schedule, v, the one-module form PipelineStage(module, group, r, p) rather than a list)
CASES = [("gpipe", 1, True), ("1f1b", 1, True), ("gpipe", 1, False), ("1f1b", 1, False)]
CASES += [("interleaved-1f1b", 2, False), ("looped-bfs", 2, False)]
CASES += [("zb-h1", 1, False), ("zbv", 2, False), ("dualpipev", 2, False), ("interleaved-zb", 2, False)]


def _mlp(n_layers):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_layers):  # an MLP block per stage, float64
        layers.append(nn.Sequential(nn.Linear(D_HID, D_HID, dtype=torch.float64), nn.ReLU()))
    return nn.Sequential(*layers)


def _loss(out, target):
    return nn.functional.mse_loss(out, target, reduction="sum")


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, D_HID, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, D_HID, generator=gen, dtype=torch.float64)


def _build(name, v, full, one_chunk):
    r, p = rank(), world_size()
    placement = SCHEDULES[name].placement
    ranges = chunk_layers(p * v, p, v, placement, r)
    mods = [copy.deepcopy(nn.Sequential(*[full[i] for i in k])) for k in ranges]
    if one_chunk:
        return PipelineStage(mods[0], world_group(), r, p, loss_fn=_loss if r == p - 1 else None), mods, ranges
    return PipelineStage(mods, world_group(), placement=placement, loss_fn=_loss), mods, ranges


def _last(stage):
    return stage.is_last


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize(("name", "v", "one_chunk"), CASES)
def test_eval_inference_mode(name, v, one_chunk):
    p = world_size()
    m = 8 if name == "dualpipev" else 4  # DualPipeV needs M >= 2p
    full = _mlp(p * v)
    x, t = _data()
    xs, ts = list(x.chunk(m)), list(t.chunk(m))
    stage, mods, _ = _build(name, v, full, one_chunk)
    with CommLedger() as ledger, torch.set_grad_enabled(rank() != 0):  # rank 0 also under no_grad
        losses = run_schedule(stage, name, xs, ts, num_microbatches=m, train=False)
    ok = all(q.grad is None for mod in mods for q in mod.parameters())
    ok &= ledger.count(op="send", phase="backward") == 0
    if _last(stage):
        with torch.no_grad():
            ref = [_loss(full(a), b) for a, b in zip(xs, ts)]
        ok &= len(losses) == m and all(torch.equal(a, b) for a, b in zip(losses, ref))
    else:
        ok &= losses is None
    assert all_true(ok), (name, rank())


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2)])
def test_return_output(name, v):
    full = _mlp(world_size() * v)
    x, t = _data()
    stage, _, _ = _build(name, v, full, False)
    got = run_schedule(stage, name, list(x.chunk(4)), list(t.chunk(4)), num_microbatches=4, scale_grads=False)
    ok = not isinstance(got, ScheduleOutput)
    ok &= (isinstance(got, list) and len(got) == 4) if _last(stage) else got is None
    assert all_true(ok)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_shape_schedules(name):
    p, m = world_size(), 8
    full = _mlp(2 * p)
    x, t = _data()
    ref_out = full(x)
    ref_loss = _loss(ref_out, t)
    ref_loss.backward()
    stage, mods, ranges = _build(name, 2, full, False)
    got = run_schedule(
        stage, name, list(x.chunk(m)), list(t.chunk(m)), num_microbatches=m, scale_grads=False, return_outputs=True
    )
    ok = True
    if _last(stage):
        ok &= torch.allclose(torch.cat(got.outputs), ref_out, rtol=1e-12, atol=1e-12)
        ok &= torch.allclose(sum(got.losses), ref_loss, rtol=1e-12, atol=1e-12)
    for mod, k in zip(mods, ranges, strict=True):
        refs = [q for i in k for q in full[i].parameters()]
        for a, b in zip(mod.parameters(), refs, strict=True):
            ok &= torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert all_true(ok), (name, rank())
