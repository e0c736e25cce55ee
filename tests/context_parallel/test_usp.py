"""usp_attention on a 2x2 (cp_ring x cp_ulysses) mesh against full single-process attention."""

import pytest
import torch

from harness.helpers import get_mesh
from shardkit import ShardkitError, ShardkitTypeError
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.context_parallel import usp_attention, usp_local_sizes, zigzag_positions


def reference_attention(q, k, v, causal):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", torch.softmax(scores, dim=-1), v)


def _mesh():
    return get_mesh((2, 2), ("cp_ring", "cp_ulysses"))


def _positions(mesh, S):
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    R, U = mesh["cp_ring"].size(), mesh["cp_ulysses"].size()
    sizes = usp_local_sizes(S, R, U)[i]
    off = split_offsets(sizes)[j]
    return zigzag_positions(S, R, i)[off : off + sizes[j]]


def _parity(B, S, n, n_kv, D, Dv, causal, dtype=torch.float64):
    mesh = _mesh()
    gen = torch.Generator().manual_seed(99)
    q, k, v, w = (torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
                  for s in ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, Dv), (B, S, n, Dv)))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, causal)
    (out_ref * w.double()).sum().backward()
    pos = _positions(mesh, S)
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    out = usp_attention(*loc, mesh, causal=causal, seq_len=S)
    (out * w[:, pos]).sum().backward()
    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in loc], [out_ref] + [t.grad for t in ref]):
        torch.testing.assert_close(got, want[:, pos].to(dtype), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.world(4)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", [
    (2, 16, 4, 4, 4, 4),
    (1, 13, 6, 2, 4, 4),   # uneven S; GQA (aligned over U = 2)
    (1, 11, 6, 3, 4, 4),   # a GQA group straddles the Ulysses boundary: KV expanded for the ring
    (1, 10, 4, 2, 3, 5),   # Dv != D: v in its own all-to-all, math block path
])
def test_parity_2x2(case, causal):
    _parity(*case, causal)


@pytest.mark.world(4)
def test_parity_float32_and_ledger():
    _parity(1, 12, 4, 2, 8, 8, True, dtype=torch.float32)
    mesh, S = _mesh(), 12
    pos = _positions(mesh, S)
    q = torch.randn(1, len(pos), 4, 4, dtype=torch.float64, requires_grad=True)
    with CommLedger() as ledger:
        usp_attention(q, q, q, mesh, causal=True, seq_len=S).sum().backward()
    assert ledger.count(op="all_to_all_single", api="ulysses_attention", phase="forward", group_size=2) == 2
    assert ledger.count(op="all_to_all_single", api="ulysses_attention", phase="backward", group_size=2) == 2
    assert ledger.count(op="send", api="ring_attention", phase="forward", group_size=2) == 1
    assert ledger.count(op="send", api="ring_attention", phase="backward", group_size=2) == 3


@pytest.mark.world(4)
def test_bad_mesh_and_heads():
    mesh = _mesh()
    q = torch.zeros(1, 4, 1, 4)
    with pytest.raises(ShardkitTypeError, match="2-D DeviceMesh"):
        usp_attention(q, q, q, mesh["cp_ring"], causal=True)
    with pytest.raises(ShardkitError, match="N >= U"):
        usp_attention(q, q, q, mesh, causal=True)
