"""Trusted shapes (``run_schedule(..., shape_key=)``, :class:`ShapeTrust`): a call repeating the
previous completed call's key receives every message without a host read of its header and
still matches backprop; a message that breaks the promise (another shape under the same key) is
flagged on the device on both ends, the call completes on every rank (no hang, messages still
paired) and the flag says so."""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group
from shardkit.comm.host_sync import HostSyncCounter
from shardkit.pipeline_parallel import PipelineStage, run_schedule


def _mse(y, t):
    return (y.tanh().mean() - t.mean()) ** 2  # any shapes: a broken promise still runs to the end


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Tanh(), nn.Linear(4, 4, dtype=torch.float64))


def _run(stage, lens, key, gen):
    xs = [torch.randn(2, s, 4, generator=gen, dtype=torch.float64) for s in lens]
    ts = [torch.randn(2, s, 4, generator=gen, dtype=torch.float64) for s in lens]
    return xs, ts, run_schedule(stage, "1f1b", xs, ts, num_microbatches=len(lens), shape_key=key)


@pytest.mark.world(2, timeout=90)
def test_a_repeated_key_reads_no_header_and_a_broken_promise_is_flagged_on_both_ends():
    r, g = rank(), world_group()
    full = _model()
    mine = copy.deepcopy(full[0] if r == 0 else full[1:])
    stage = PipelineStage(mine, g, r, 2, loss_fn=_mse if r == 1 else None)
    gen = torch.Generator().manual_seed(3)
    _run(stage, [3, 3], "k", gen)  # negotiates every channel
    ok = stage.shape_trust.take() is None
    mine.zero_grad()
    full.zero_grad()
    counter = HostSyncCounter("cpu")
    with counter:
        xs, ts, losses = _run(stage, [3, 3], "k", gen)  # trusted: no header read
    reads = [k for k in counter._current["reads"] if "_packed.py" in k]
    ok &= not reads
    flag = stage.shape_trust.take()
    ok &= flag is not None and not bool(flag)
    ref = [_mse(full(x), t) for x, t in zip(xs, ts, strict=True)]
    (sum(ref) / 2).backward()
    if r == 1:
        ok &= all(torch.allclose(a, b.detach(), rtol=1e-12) for a, b in zip(losses, ref, strict=True))
    for a, b in zip(mine.parameters(), (full[0] if r == 0 else full[1:]).parameters(), strict=True):
        ok &= torch.allclose(a.grad, b.grad, rtol=1e-12)
    _run(stage, [3, 5], "k", gen)  # the promise broken: flagged, the call still completes
    flag = stage.shape_trust.take()
    ok &= flag is not None and bool(flag)
    assert all_true(ok), (reads, flag)
