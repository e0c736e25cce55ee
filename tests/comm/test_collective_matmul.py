"""Collective matmul (``shardkit.comm.collective_matmul``) against the synchronous collectives
it decomposes: float64 outputs and every gradient, even and uneven (zero-size) sequence blocks,
tp 2 and 4; the ledger of its ring steps."""

import pytest
import torch
import torch.nn.functional as F

from harness.helpers import rank, world_group, world_size
from shardkit import CommLedger
from shardkit._shapes import balanced_split_sizes, split_offsets
from shardkit.comm import all_gather, reduce_scatter
from shardkit.comm._group import resolve_group
from shardkit.comm.collective_matmul import all_gather_matmul, matmul_reduce_scatter

RTOL = 1e-12


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _leaf(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def _ag_case(S, keep, bias):
    """Both paths on the same per-rank data; returns (async, sync) values and gradients."""
    R, r = world_size(), rank()
    sizes = balanced_split_sizes(S, R)
    g = resolve_group(world_group(), "test")
    out = []
    for mode in ("async", "sync"):
        x = _leaf(2, sizes[r], 6, seed=10 + r)
        ws = [_leaf(5, 6, seed=20 + 3 * r + j) for j in range(2)]
        bs = [_leaf(5, seed=40 + r) if bias else None, None]
        dys = [
            torch.randn(2, S, 5, generator=torch.Generator().manual_seed(60 + 2 * r + j), dtype=torch.float64)
            for j in range(2)
        ]
        dfull = torch.randn(2, S, 6, generator=torch.Generator().manual_seed(80 + r), dtype=torch.float64)
        if mode == "async":
            full, ys = all_gather_matmul(x, g, 1, sizes, ws, bs, keep)
        else:
            full = all_gather(x, world_group(), 1, sizes)
            ys = [F.linear(full, w, b) for w, b in zip(ws, bs)]
        loss = (full * dfull).sum() + sum((y * dy).sum() for y, dy in zip(ys, dys))
        loss.backward()
        out.append(
            [full.detach(), *[y.detach() for y in ys], x.grad, *[w.grad for w in ws]] + ([bs[0].grad] if bias else [])
        )
    return out


@pytest.mark.world(2)
@pytest.mark.parametrize("S,keep,bias", [(8, "shard", True), (7, "gathered", False)])
def test_all_gather_matmul_parity_tp2(S, keep, bias):
    a, s = _ag_case(S, keep, bias)
    assert all(_rel(u, v) <= RTOL for u, v in zip(a, s)), [_rel(u, v) for u, v in zip(a, s)]


@pytest.mark.world(4)
@pytest.mark.parametrize("S,keep", [(7, "shard"), (3, "shard"), (8, "gathered")])
def test_all_gather_matmul_parity_tp4(S, keep):
    """S 3 over 4 ranks: blocks [1, 1, 1, 0], a rank with no tokens sends nothing."""
    a, s = _ag_case(S, keep, True)
    assert all(_rel(u, v) <= RTOL for u, v in zip(a, s)), [_rel(u, v) for u, v in zip(a, s)]


def _mrs_case(S):
    R, r = world_size(), rank()
    sizes = balanced_split_sizes(S, R)
    g = resolve_group(world_group(), "test")
    out = []
    for mode in ("async", "sync"):
        x = _leaf(2, S, 3, seed=100 + r)
        w = _leaf(5, 3, seed=200 + r)
        dy = torch.randn(2, sizes[r], 5, generator=torch.Generator().manual_seed(300 + r), dtype=torch.float64)
        if mode == "async":
            y = matmul_reduce_scatter(x, w, g, 1, sizes)
        else:
            y = reduce_scatter(F.linear(x, w), world_group(), 1, sizes)
        (y * dy).sum().backward()
        out.append([y.detach(), x.grad, w.grad])
    return out


@pytest.mark.world(2)
@pytest.mark.parametrize("S", [8, 5])
def test_matmul_reduce_scatter_parity_tp2(S):
    a, s = _mrs_case(S)
    assert all(_rel(u, v) <= RTOL for u, v in zip(a, s)), [_rel(u, v) for u, v in zip(a, s)]


@pytest.mark.world(4)
@pytest.mark.parametrize("S", [7, 2])
def test_matmul_reduce_scatter_parity_tp4(S):
    """S 2 over 4 ranks: two ranks own nothing (zero-size accumulators are not sent)."""
    a, s = _mrs_case(S)
    assert all(_rel(u, v) <= RTOL for u, v in zip(a, s)), [_rel(u, v) for u, v in zip(a, s)]


@pytest.mark.world(4)
def test_ring_ledger_is_p2p_blocks():
    """Forward: R - 1 sends and receives of one sequence block each (no all-gather, no
    reduce-scatter: the gather is not done whole); backward: the reduce-scatter ring and the
    shard's regather ring, each R - 1 blocks."""
    R, r, S = world_size(), rank(), 8
    sizes = balanced_split_sizes(S, R)
    g = resolve_group(world_group(), "test")
    x = _leaf(2, sizes[r], 6, seed=r)
    w = _leaf(5, 6, seed=9)
    with CommLedger() as fwd:
        full, (y,) = all_gather_matmul(x, g, 1, sizes, [w], [None])
    assert {rec.op for rec in fwd.records} == {"send", "recv"}, fwd.summary()
    block = 2 * (S // R) * 6 * 8
    assert fwd.count(op="send", api="all_gather_matmul", phase="forward", group_size=R) == R - 1
    assert fwd.bytes_sent(op="send") == fwd.bytes_received(op="recv") == (R - 1) * block
    with CommLedger() as bwd:
        y.sum().backward()
    assert bwd.count(op="send", api="all_gather_matmul", phase="backward") == R - 1
    assert bwd.count(op="send", api="sp_regather", phase="recompute") == R - 1
    assert bwd.count() == 4 * (R - 1), bwd.summary()
    assert bwd.bytes_sent() == 2 * (R - 1) * block
    offsets = split_offsets(sizes)
    assert full.shape[1] == S and offsets[-1] + sizes[-1] == S
