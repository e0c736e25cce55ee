"""usp_attention on a 2x2 (cp_ring x cp_ulysses) mesh against full single-process attention."""

import pytest
import torch

from harness.attention import reference_attention
from harness.helpers import get_mesh
from shardkit import ShardkitError, ShardkitTypeError
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.context_parallel import usp_attention, usp_local_sizes, zigzag_positions


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
    q, k, v, w = (
        torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
        for s in ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, Dv), (B, S, n, Dv))
    )
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, causal)
    (out_ref * w.double()).sum().backward()
    pos = _positions(mesh, S)
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    out = usp_attention(*loc, mesh, causal=causal, seq_len=S)
    (out * w[:, pos]).sum().backward()
    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), [out] + [t.grad for t in loc], [out_ref] + [t.grad for t in ref]
    ):
        torch.testing.assert_close(
            got, want[:, pos].to(dtype), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.world(4)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "case",
    [
        (2, 16, 4, 4, 4, 4),
        (1, 13, 6, 2, 4, 4),  # uneven S; GQA (aligned over U = 2)
        (1, 11, 6, 3, 4, 4),  # a GQA group straddles the Ulysses boundary: KV expanded for the ring
        (1, 10, 4, 2, 3, 5),  # Dv != D: v in its own all-to-all, math block path
    ],
)
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


# ---------------------------------------------------------------- packed documents


def _packed_reference(q, k, v, causal, cu):
    S, rep = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= torch.ones(S, S, dtype=torch.bool).tril()
    scores = (torch.einsum("bqnd,bknd->bnqk", q, k) * q.shape[-1] ** -0.5).masked_fill(~keep, float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", torch.softmax(scores, dim=-1), v)


def _packed_parity(B, lengths, n, n_kv, D, Dv, causal, dtype=torch.float64):
    from shardkit.context_parallel.usp import usp_indices

    mesh = _mesh()
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    gen = torch.Generator().manual_seed(7)
    S = cu[-1]
    q, k, v, w = (
        torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
        for s in ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, Dv), (B, S, n, Dv))
    )
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out_ref = _packed_reference(*ref, causal, cu)
    (out_ref * w.double()).sum().backward()
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    pos = usp_indices(cu, 2, 2, i, j)
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    with CommLedger() as ledger:
        out = usp_attention(*loc, mesh, causal=causal, cu_seqlens=cu)
        (out * w[:, pos]).sum().backward()
    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), [out] + [t.grad for t in loc], [out_ref] + [t.grad for t in ref]
    ):
        torch.testing.assert_close(
            got, want[:, pos].to(dtype), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )
    n_a2a = 2 if Dv == D else 3
    for phase, sends in (("forward", 1), ("backward", 3)):
        assert ledger.count(op="all_to_all_single", api="ulysses_attention", phase=phase, group_size=2) == n_a2a
        assert ledger.count(op="send", api="ring_attention", phase=phase, group_size=2) == sends
        assert ledger.count(op="recv", api="ring_attention", phase=phase, group_size=2) == sends
    assert ledger.count() == 2 * n_a2a + 2 * (1 + 3)


@pytest.mark.world(4)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "case",
    [
        (1, [9, 3, 0, 12, 1, 5], 4, 2, 4, 4),  # documents shorter than 2R = 4, a zero-length one
        (2, [0, 7, 2, 0, 10, 0], 6, 2, 4, 4),  # GQA, zero-length first / last documents
        (1, [5, 1, 6], 6, 3, 3, 5),  # a GQA group straddles the Ulysses ranks; Dv != D
    ],
)
def test_packed_parity_2x2(case, causal):
    _packed_parity(*case, causal)


@pytest.mark.world(4)
def test_packed_float32_and_layout():
    """float32 parity; the USP indices tile the packed sequence, each ring part is its packed zigzag part."""
    from shardkit.context_parallel import packed_indices
    from shardkit.context_parallel.usp import usp_indices, usp_packed_local_sizes

    _packed_parity(1, [6, 2, 11], 4, 2, 8, 8, True, dtype=torch.float32)
    cu = [0, 9, 12, 12, 24, 25, 30]
    seen = torch.cat([usp_indices(cu, 2, 2, i, j) for i in range(2) for j in range(2)])
    assert sorted(seen.tolist()) == list(range(30))
    for i in range(2):
        assert torch.equal(torch.cat([usp_indices(cu, 2, 2, i, j) for j in range(2)]), packed_indices(cu, 2, i))
        assert [len(usp_indices(cu, 2, 2, i, j)) for j in range(2)] == usp_packed_local_sizes(cu, 2, 2)[i]
    with pytest.raises(ShardkitError, match="ends at"):
        usp_attention(
            torch.zeros(1, 8, 4, 4),
            torch.zeros(1, 8, 4, 4),
            torch.zeros(1, 8, 4, 4),
            _mesh(),
            causal=True,
            cu_seqlens=cu,
            seq_len=31,
        )
