"""ring_attention on packed documents (cu_seqlens) against full block-diagonal attention; overlap switch."""

import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank, world_group, world_size
from harness.limits import patient
from shardkit import ShardkitError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.context_parallel import packed_gather, packed_indices, packed_local_sizes, ring, ring_attention


def reference_attention(q, k, v, causal, cu, scale=None):
    """Full attention in plain float64 math with a block-diagonal (document) mask, causal within a document."""
    S, rep = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= torch.ones(S, S, dtype=torch.bool).tril()
    scores = (torch.einsum("bqnd,bknd->bnqk", q, k) * scale).masked_fill(~keep, float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", torch.softmax(scores, dim=-1), v)


def _inputs(B, S, n, n_kv, D, Dv, dtype):
    gen = torch.Generator().manual_seed(2024)  # identical on every rank: the full problem
    shapes = ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, Dv), (B, S, n, Dv))
    return [torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _positions(layout, cu, R, r):
    if layout == "zigzag":
        return packed_indices(cu, R, r)
    sizes = balanced_split_sizes(cu[-1], R)
    return torch.arange(split_offsets(sizes)[r], split_offsets(sizes)[r] + sizes[r])


def _parity(B, lengths, n, n_kv, D, Dv, causal, *, min_tile=0, layout="zigzag", dtype=torch.float64, overlap=True):
    """Every rank runs its part through ring_attention; compare to the full block-diagonal reference."""
    cu = _cu(lengths)
    S, R, r = cu[-1], world_size(), rank()
    q, k, v, w = _inputs(B, S, n, n_kv, D, Dv, dtype)
    ref = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, causal, cu)
    (out_ref * w.to(torch.float64)).sum().backward()

    pos = _positions(layout, cu, R, r)
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    saved, ring.PACKED_MIN_TILE = ring.PACKED_MIN_TILE, min_tile
    try:
        out = ring_attention(*loc, world_group(), causal=causal, layout=layout, cu_seqlens=cu, overlap=overlap)
    finally:
        ring.PACKED_MIN_TILE = saved
    (out * w[:, pos]).sum().backward()

    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    pairs = [(out, out_ref)] + [(a.grad, b.grad) for a, b in zip(loc, ref)]
    for name, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
        want = want[:, pos].to(dtype)
        assert got.dtype == dtype and got.shape == want.shape, (name, got.shape, want.shape)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    return out.detach(), [t.grad for t in loc]


# Document lengths: long ones (>= 2R), ones shorter than 2R, zero-length ones (first, middle, last).
DOCS = {
    "mixed": [9, 3, 0, 12, 1, 5],
    "zeros": [0, 7, 0, 0, 2, 10, 0],
    "short": [1, 2, 3, 1, 2],
}


@pytest.mark.world(2)
@pytest.mark.parametrize("min_tile", [0, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", sorted(DOCS))
def test_packed_parity_r2(docs, causal, min_tile):
    _parity(2, DOCS[docs], 4, 2, 4, 4, causal, min_tile=min_tile)


@pytest.mark.world(3)
@pytest.mark.parametrize("min_tile", [0, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", sorted(DOCS))
def test_packed_parity_r3_gqa(docs, causal, min_tile):
    _parity(1, DOCS[docs], 6, 2, 4, 4, causal, min_tile=min_tile)


@pytest.mark.world(4)
@pytest.mark.parametrize("min_tile", [0, 4, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", sorted(DOCS))
def test_packed_parity_r4_gqa(docs, causal, min_tile):
    _parity(1, DOCS[docs], 6, 2, 4, 4, causal, min_tile=min_tile)


@pytest.mark.world(3)
def test_packed_parity_float32_math_path_contiguous():
    _parity(1, [10, 2, 0, 13], 4, 2, 8, 8, True, dtype=torch.float32)
    _parity(1, [10, 2, 0, 13], 4, 2, 8, 8, True, min_tile=64, dtype=torch.float32)
    _parity(1, [7, 1, 6], 4, 4, 3, 5, True, min_tile=4)  # Dv != D: plain-math blocks with masks
    for causal in (True, False):
        for min_tile in (0, 64):
            _parity(1, DOCS["mixed"], 6, 3, 4, 4, causal, min_tile=min_tile, layout="contiguous")


@pytest.mark.world(4)
def test_one_document_matches_unpacked_and_gather():
    """cu_seqlens = [0, S] is the plain zigzag layout; the packed gather of the output is full attention."""
    S, R = 14, world_size()
    q, k, v, _ = _inputs(1, S, 4, 2, 4, 4, torch.float64)
    pos = packed_indices([0, S], R, rank())
    loc = [t[:, pos] for t in (q, k, v)]
    a = ring_attention(*loc, world_group(), causal=True, cu_seqlens=[0, S])
    b = ring_attention(*loc, world_group(), causal=True, seq_len=S)
    assert torch.equal(a, b)
    cu = _cu(DOCS["mixed"])
    q, k, v, _ = _inputs(2, cu[-1], 4, 2, 4, 4, torch.float64)
    pos = packed_indices(cu, R, rank())
    out = ring_attention(q[:, pos], k[:, pos], v[:, pos], world_group(), causal=True, cu_seqlens=torch.tensor(cu))
    full = packed_gather(out, cu, world_group(), dim=1)
    torch.testing.assert_close(full, reference_attention(q, k, v, True, cu), rtol=1e-9, atol=1e-12)


@pytest.mark.world(4)
@pytest.mark.parametrize("causal", [True, False])
def test_overlap_switch_is_bitwise_identical(causal):
    a_out, a_grads = _parity(1, DOCS["mixed"], 4, 2, 4, 4, causal, overlap=True)
    b_out, b_grads = _parity(1, DOCS["mixed"], 4, 2, 4, 4, causal, overlap=False)
    assert torch.equal(a_out, b_out) and all(torch.equal(x, y) for x, y in zip(a_grads, b_grads))


# ---------------------------------------------------------------- ledger and skipped blocks


@pytest.mark.world(3)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_ledger_exact_counts(causal):
    """Packed: the same R - 1 forward and 2R - 1 backward exchanges, bytes from the packed local sizes."""
    R, B, n, n_kv, D, Dv = 3, 2, 6, 2, 4, 4
    cu = _cu(DOCS["mixed"])
    q, k, v, _ = _inputs(B, cu[-1], n, n_kv, D, Dv, torch.float64)
    pos = packed_indices(cu, R, rank())
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    with CommLedger() as ledger:
        out = ring_attention(*loc, world_group(), causal=causal, cu_seqlens=cu)
        assert ledger.count() == 2 * (R - 1)
        out.sum().backward()
    for op in ("send", "recv"):
        assert ledger.count(op=op, api="ring_attention", phase="forward", group_size=R) == R - 1
        assert ledger.count(op=op, api="ring_attention", phase="backward", group_size=R) == 2 * R - 1
    assert ledger.count() == 2 * (3 * R - 2)
    per_token = B * n_kv * (D + Dv) * 8
    tokens = packed_local_sizes(cu, R)
    assert (
        ledger.bytes_sent(op="send", phase="forward") == sum(tokens[(rank() - i) % R] for i in range(R - 1)) * per_token
    )
    assert (
        ledger.bytes_received(op="recv", phase="forward")
        == sum(tokens[(rank() - i) % R] for i in range(1, R)) * per_token
    )
    assert (
        ledger.bytes_sent(op="send", phase="backward")
        == (sum(tokens[(rank() - i) % R] for i in range(R - 1)) + sum(tokens)) * per_token
    )


def _count_blocks(lengths, causal, min_tile):
    cu = _cu(lengths)
    q, k, v, _ = _inputs(1, cu[-1], 2, 2, 4, 4, torch.float64)
    pos = packed_indices(cu, world_size(), rank())
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    saved, ring.PACKED_MIN_TILE = ring.PACKED_MIN_TILE, min_tile
    counts = Counter()
    try:
        ring_attention(*loc, world_group(), causal=causal, cu_seqlens=cu, block_counts=counts).sum().backward()
    finally:
        ring.PACKED_MIN_TILE = saved
    assert counts["forward"] == counts["backward"], dict(counts)
    return counts["forward"]


@pytest.mark.world(4)
def test_cross_document_blocks_are_skipped():
    """Per document of >= 2R tokens: 2R + 1 causal chunk pairs (zigzag) or R non-causal blocks per
    rank, nothing across documents; zero-length documents cost nothing. Merged tiles: at most one
    block per step."""
    R, lengths = world_size(), [8, 0, 11, 9, 0]
    assert _count_blocks(lengths, True, 0) == 3 * (2 * R + 1)
    assert _count_blocks(lengths, False, 0) == 3 * R
    assert _count_blocks([1, 1, 1, 1, 1, 1, 1, 1], True, 64) <= R  # 8 one-token documents
    # one-token documents: each is a diagonal block of its own, nothing across them
    assert _count_blocks([1] * (2 * R), True, 0) == (2 * R if rank() == 0 else 0)  # chunk 0 of each is on rank 0


# ---------------------------------------------------------------- errors


@pytest.mark.world(3)
@pytest.mark.parametrize("case", ["wrong_total", "decreasing", "wrong_local", "overlap_type"])
def test_bad_packed_input_raises_on_every_rank(case):
    from shardkit import ShardkitTypeError

    g = world_group()
    cu = [0, 5, 9, 12]
    n_local = packed_local_sizes(cu, world_size())[rank()]
    q = torch.zeros(1, n_local, 2, 4)
    fns = {
        "wrong_total": (
            ShardkitError,
            "ends at",
            lambda: ring_attention(q, q, q, g, causal=True, cu_seqlens=cu, seq_len=13),
        ),
        "decreasing": (
            ShardkitError,
            "non-decreasing",
            lambda: ring_attention(q, q, q, g, causal=True, cu_seqlens=[0, 5, 4, 12]),
        ),
        "wrong_local": (
            ShardkitError,
            "3 documents",
            lambda: ring_attention(q[:, :0], q[:, :0], q[:, :0], g, causal=True, cu_seqlens=cu),
        ),
        "overlap_type": (
            ShardkitTypeError,
            "overlap",
            lambda: ring_attention(q, q, q, g, causal=True, cu_seqlens=cu, overlap=1),
        ),
    }
    expected_type, fragment, fn = fns[case]
    start = time.monotonic()
    with pytest.raises(expected_type, match=fragment) as info:
        fn()
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    outcomes = [None] * world_size()
    dist.all_gather_object(outcomes, (type(info.value).__name__, str(info.value).split(": rank")[0]), group=g)
    assert all(o == outcomes[0] for o in outcomes), outcomes
