"""ring_attention against full single-process attention: output and dq, dk, dv; ledger; skipped blocks; errors."""

import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank, world_group, world_size
from harness.limits import patient
from shardkit import ShardkitError, ShardkitTypeError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.context_parallel import ring, ring_attention, ring_chunks, zigzag_gather, zigzag_positions


def reference_attention(q, k, v, causal, scale=None):
    """Full attention in plain float64 math, KV heads repeated per GQA group."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * scale
    if causal:
        keep = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", torch.softmax(scores, dim=-1), v)


def _inputs(B, S, n, n_kv, D, Dv, dtype):
    gen = torch.Generator().manual_seed(1234)  # identical on every rank: the full problem
    shapes = ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, Dv), (B, S, n, Dv))
    return [torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype) for shape in shapes]


def _positions(layout, S, R, r):
    if layout == "zigzag":
        return zigzag_positions(S, R, r)
    sizes = balanced_split_sizes(S, R)
    return torch.arange(split_offsets(sizes)[r], split_offsets(sizes)[r] + sizes[r])


def _parity(B, S, n, n_kv, D, Dv, causal, layout="zigzag", dtype=torch.float64, scale=None, noncontig=False):
    """Every rank runs its part through ring_attention; compare to the full reference."""
    group = world_group()
    R, r = world_size(), rank()
    q, k, v, w = _inputs(B, S, n, n_kv, D, Dv, dtype)
    ref = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, causal, scale)
    (out_ref * w.to(torch.float64)).sum().backward()

    pos = _positions(layout, S, R, r)
    if noncontig:  # [B, N, S, D] storage seen as [B, S, N, D]
        leaves = [t[:, pos].transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        loc = [t.transpose(1, 2) for t in leaves]
    else:
        leaves = loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*loc, group, causal=causal, scale=scale, layout=layout, seq_len=S)
    (out * w[:, pos]).sum().backward()
    grads = [t.grad.transpose(1, 2) if noncontig else t.grad for t in leaves]

    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    pairs = [(out, out_ref)] + [(a, b.grad) for a, b in zip(grads, ref)]
    for name, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
        want = want[:, pos].to(dtype)
        assert got.dtype == dtype and got.shape == want.shape, (name, got.shape, want.shape)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# (B, S, N, N_kv, D, Dv): S not a multiple of 2R for R in {2, 3, 4} except 16 at R = 2 and 4;
# N=6, N_kv=2 is GQA (only N_kv heads travel); Dv != D takes the plain-math block path.
CASES = [
    (2, 11, 3, 3, 4, 4),
    (1, 16, 6, 2, 4, 4),
    (1, 9, 6, 2, 3, 5),
]


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_parity_r2(case, causal, layout):
    _parity(*case, causal, layout)


@pytest.mark.world(3)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES + [(1, 5, 2, 1, 4, 4)])  # S = 5 < 2R: a zero-size chunk
def test_parity_r3(case, causal, layout):
    _parity(*case, causal, layout)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES + [(1, 13, 6, 1, 4, 4)])  # MQA: one KV head for all
def test_parity_r4(case, causal, layout):
    _parity(*case, causal, layout)


@pytest.mark.world(3)
def test_parity_float32_custom_scale_noncontiguous():
    _parity(2, 14, 6, 2, 8, 8, True, dtype=torch.float32)
    _parity(1, 10, 4, 4, 4, 4, True, scale=0.3, noncontig=True)
    _parity(1, 7, 4, 2, 4, 4, False, layout="contiguous", noncontig=True)


@pytest.mark.world(1)
def test_single_rank_is_plain_attention():
    with CommLedger() as ledger:
        _parity(2, 6, 6, 2, 4, 4, True)
        _parity(1, 5, 2, 2, 4, 4, False, layout="contiguous")
    assert ledger.count() == 0


@pytest.mark.world(2)
def test_gathered_output_matches_reference():
    """The output gathered with the layout's own gather equals full attention."""
    S = 9
    q, k, v, _ = _inputs(1, S, 4, 2, 4, 4, torch.float64)
    pos = zigzag_positions(S, 2, rank())
    out = ring_attention(q[:, pos], k[:, pos], v[:, pos], world_group(), causal=True, seq_len=S)
    full = zigzag_gather(out, world_group(), dim=1, seq_len=S)
    torch.testing.assert_close(full, reference_attention(q, k, v, True), rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- ledger and skipped blocks


@pytest.mark.world(3)
@pytest.mark.parametrize("causal", [True, False])
def test_ledger_exact_counts(causal):
    """Forward: R - 1 KV exchanges; backward: R - 1 KV exchanges and R dK/dV exchanges."""
    R, B, S, n, n_kv, D, Dv = 3, 2, 13, 6, 2, 4, 4
    q, k, v, _ = _inputs(B, S, n, n_kv, D, Dv, torch.float64)
    pos = zigzag_positions(S, R, rank())
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    with CommLedger() as ledger:
        out = ring_attention(*loc, world_group(), causal=causal, seq_len=S)
        fwd = ledger.count()
        out.sum().backward()
    assert fwd == 2 * (R - 1)
    for op in ("send", "recv"):
        assert ledger.count(op=op, api="ring_attention", phase="forward", group_size=R) == R - 1
        assert ledger.count(op=op, api="ring_attention", phase="backward", group_size=R) == 2 * R - 1
    assert ledger.count() == 2 * (3 * R - 2)
    # bytes: forward sends this rank's block, then the blocks of ranks r - 1, r - 2 (k and v packed)
    per_token = B * n_kv * (D + Dv) * 8
    tokens = [len(zigzag_positions(S, R, s)) for s in range(R)]
    assert (
        ledger.bytes_sent(op="send", phase="forward") == sum(tokens[(rank() - i) % R] for i in range(R - 1)) * per_token
    )
    assert (
        ledger.bytes_received(op="recv", phase="forward")
        == sum(tokens[(rank() - i) % R] for i in range(1, R)) * per_token
    )
    # backward: the same KV traffic, plus every block's dK/dV once around the whole ring (float64 here)
    assert (
        ledger.bytes_sent(op="send", phase="backward")
        == (sum(tokens[(rank() - i) % R] for i in range(R - 1)) + sum(tokens)) * per_token
    )


@pytest.mark.world(4)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_causal_skips_fully_masked_blocks(layout):
    """Zigzag: 2R + 1 of the 4R chunk pairs on every rank (balanced); contiguous: rank r computes r + 1 blocks."""
    R, S = 4, 16
    q, k, v, _ = _inputs(1, S, 2, 2, 4, 4, torch.float64)
    pos = _positions(layout, S, R, rank())
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    for causal in (True, False):
        counts = Counter()
        ring_attention(
            *loc, world_group(), causal=causal, layout=layout, seq_len=S, block_counts=counts
        ).sum().backward()
        if not causal:
            want = R  # one block per step, the whole local query against the whole KV block
        else:
            want = 2 * R + 1 if layout == "zigzag" else rank() + 1
        assert counts["forward"] == want and counts["backward"] == want, (causal, dict(counts))


def test_ring_chunks_cover_the_sequence():
    for layout in ("zigzag", "contiguous"):
        for S, R in ((11, 3), (16, 4), (3, 4), (0, 2)):
            ids = []
            for r in range(R):
                chunks = ring_chunks(layout, S, R, r)
                assert sum(c[2] for c in chunks) == len(_positions(layout, S, R, r))
                ids += [c[0] for c in chunks]
            assert sorted(ids) == list(range(len(ids)))


# ---------------------------------------------------------------- errors


def _bad_cases():
    g = world_group()
    q = torch.zeros(1, 4, 6, 4)
    kv = torch.zeros(1, 4, 2, 4)
    S = 4 * world_size()
    return {
        "kv_not_dividing": (
            ShardkitError,
            "multiple of the number of KV heads",
            lambda: ring_attention(q, torch.zeros(1, 4, 4, 4), torch.zeros(1, 4, 4, 4), g, causal=True),
        ),
        "not_4d": (ShardkitError, r"\[B, S_local, N, D\]", lambda: ring_attention(q[0], kv[0], kv[0], g, causal=True)),
        "mixed_dtypes": (ShardkitTypeError, "dtype", lambda: ring_attention(q, kv.double(), kv, g, causal=False)),
        "bad_layout": (ShardkitError, "layout", lambda: ring_attention(q, kv, kv, g, causal=True, layout="striped")),
        "wrong_local_length": (
            ShardkitError,
            "holds 4 tokens",
            lambda: ring_attention(q, kv, kv, g, causal=True, seq_len=2 * S),
        ),
        "group_none": (ShardkitTypeError, "group is required", lambda: ring_attention(q, kv, kv, None, causal=True)),
    }


@pytest.mark.world(3)
@pytest.mark.parametrize(
    "case", ["kv_not_dividing", "not_4d", "mixed_dtypes", "bad_layout", "wrong_local_length", "group_none"]
)
def test_bad_input_raises_on_every_rank(case):
    expected_type, fragment, fn = _bad_cases()[case]
    start = time.monotonic()
    with pytest.raises(expected_type, match=fragment) as info:
        fn()
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    outcomes = [None] * world_size()
    dist.all_gather_object(
        outcomes, (type(info.value).__name__, str(info.value).split(": rank")[0]), group=world_group()
    )
    assert all(o == outcomes[0] for o in outcomes), outcomes
    t = torch.ones(1)
    dist.all_reduce(t, group=world_group())
    assert t.item() == world_size()


@pytest.mark.world(3)
def test_transfers_are_posted_before_compute():
    """Overlap: each step posts the next KV transfer before its own block; dK/dV leave after it."""
    events = []
    post, fwd, bwd = ring._Ring.post, ring.block_forward, ring.block_backward

    def traced(name, fn):
        def wrapper(*args, **kwargs):
            events.append(name if name != "post" else f"post-{args[3]}")
            return fn(*args, **kwargs)

        return wrapper

    S = 9
    q, k, v, _ = _inputs(1, S, 2, 2, 4, 4, torch.float64)
    pos = zigzag_positions(S, 3, rank())
    loc = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    ring._Ring.post, ring.block_forward, ring.block_backward = traced("post", post), traced("F", fwd), traced("B", bwd)
    try:
        out = ring_attention(*loc, world_group(), causal=False, seq_len=S)
        out.sum().backward()
    finally:
        ring._Ring.post, ring.block_forward, ring.block_backward = post, fwd, bwd
    assert events == ["post-forward", "F", "post-forward", "F", "F"] + [
        "post-backward",
        "B",
        "post-backward",
        "post-backward",
        "B",
        "post-backward",
        "B",
        "post-backward",
    ], events


def test_the_removed_block_counts_name_the_replacement():
    with pytest.raises(AttributeError, match=r"block_counts=collections.Counter\(\)"):
        ring.BLOCK_COUNTS  # noqa: B018
