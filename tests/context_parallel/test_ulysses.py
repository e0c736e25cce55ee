"""ulysses_attention against full single-process attention: output and dq, dk, dv; ledger; errors."""

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.helpers import get_mesh, rank, world_group, world_size
from harness.limits import patient
from shardkit import ShardkitError, ShardkitTypeError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.context_parallel import attention_with_lse, ulysses_attention, ulysses_head_plan


def reference_attention(q, k, v, causal, scale=None, cu=None):
    """Full attention in plain math: KV heads repeated per GQA group, causal and document masks."""
    n, n_kv, S = q.shape[2], k.shape[2], q.shape[1]
    k, v = k.repeat_interleave(n // n_kv, dim=2), v.repeat_interleave(n // n_kv, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * scale
    keep = torch.ones(S, S, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    if cu is not None:
        doc = torch.zeros(S, dtype=torch.int64)
        for i in range(1, len(cu) - 1):
            doc[cu[i] :] += 1
        keep &= doc[:, None] == doc[None, :]
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("bnqk,bknd->bqnd", probs, v)


def _inputs(B, S, n, n_kv, D, Dv, dtype):
    gen = torch.Generator().manual_seed(4321)  # identical on every rank: the full problem
    q, k, v, w = (
        torch.randn(*shape, generator=gen, dtype=torch.float64)
        for shape in ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, Dv), (B, S, n, Dv))
    )
    return [t.to(dtype) for t in (q, k, v, w)]


def _parity(B, S, n, n_kv, D, Dv, causal, cu=None, dtype=torch.float64, group=None, scale=None, noncontig=False):
    """Every rank runs its block through ulysses_attention; compare to the full reference."""
    group = world_group() if group is None else group
    pg = group.get_group() if hasattr(group, "get_group") else group  # a 1-D DeviceMesh or a group
    R, r = dist.get_world_size(pg), dist.get_rank(pg)
    q, k, v, w = _inputs(B, S, n, n_kv, D, Dv, dtype)
    ref = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, causal, scale, cu)
    (out_ref * w.to(torch.float64)).sum().backward()

    sizes = balanced_split_sizes(S, R)
    off, n_r = split_offsets(sizes)[r], sizes[r]
    if noncontig:  # [B, N, S, D] storage seen as [B, S, N, D], as HF attention layers hold it
        leaves = [t[:, off : off + n_r].transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        loc = [t.transpose(1, 2) for t in leaves]
    else:
        leaves = loc = [t[:, off : off + n_r].clone().requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*loc, group, causal=causal, scale=scale, cu_seqlens=cu, seq_len=S)
    (out * w[:, off : off + n_r]).sum().backward()
    grads = [t.grad.transpose(1, 2) if noncontig else t.grad for t in leaves]

    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-5, 1e-5)
    pairs = [(out, out_ref)] + [(a, b.grad) for a, b in zip(grads, ref)]
    for name, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
        want = want[:, off : off + n_r].to(dtype)
        assert got.dtype == dtype and got.shape == want.shape, (name, got.shape, want.shape)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# (B, S, N, N_kv, D, Dv): S and N uneven for every R in {2, 3, 4}; N=6, N_kv=2 is GQA whose
# groups straddle rank boundaries at R = 3 and 4; Dv != D moves v in its own all-to-all.
CASES = [
    (2, 7, 5, 5, 4, 4),
    (1, 11, 6, 2, 4, 4),
    (2, 9, 6, 3, 3, 5),
    (1, 10, 8, 4, 2, 2),
]


@pytest.mark.world(2)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_parity_r2(case, causal):
    _parity(*case, causal)


@pytest.mark.world(3)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES + [(2, 2, 2, 1, 4, 4)])  # S = 2, N = 2 < R: zero tokens / heads on a rank
def test_parity_r3(case, causal):
    _parity(*case, causal)


@pytest.mark.world(4)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES + [(1, 13, 6, 1, 4, 4)])  # MQA: one KV head for all
def test_parity_r4(case, causal):
    _parity(*case, causal)


@pytest.mark.world(3)
def test_parity_float32_and_custom_scale():
    _parity(2, 10, 6, 2, 8, 8, True, dtype=torch.float32)
    _parity(1, 8, 5, 5, 4, 4, False, scale=0.3)


@pytest.mark.world(2)
def test_parity_non_contiguous_inputs():
    _parity(2, 7, 6, 2, 4, 4, True, noncontig=True)
    _parity(1, 9, 5, 5, 4, 4, False, noncontig=True)


# Packed documents: several lengths, some shorter than R, one empty.
PACKED = [[0, 3, 4, 10, 10, 13], [0, 1, 2, 9], [0, 13]]


@pytest.mark.world(2)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_r2(causal):
    for cu in PACKED:
        _parity(1, cu[-1], 4, 2, 4, 4, causal, cu=cu)


@pytest.mark.world(3)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_r3(causal):
    for cu in PACKED:
        _parity(2, cu[-1], 6, 2, 4, 4, causal, cu=cu)


@pytest.mark.world(4)
def test_packed_r4_tensor_cu_seqlens():
    _parity(1, 13, 6, 2, 4, 4, True, cu=PACKED[0])
    q, k, v, _ = _inputs(1, 13, 4, 4, 2, 2, torch.float64)
    sizes, R = balanced_split_sizes(13, 4), world_size()
    off = split_offsets(sizes)[rank()]
    loc = [t[:, off : off + sizes[rank()]] for t in (q, k, v)]
    a = ulysses_attention(*loc, world_group(), causal=True, cu_seqlens=torch.tensor(PACKED[0], dtype=torch.int32))
    b = ulysses_attention(*loc, world_group(), causal=True, cu_seqlens=PACKED[0])
    assert torch.equal(a, b) and R == 4


@pytest.mark.world(4)
def test_on_a_mesh_dimension():
    """The Ulysses group as one dim of a 2-D mesh: two independent 2-rank groups."""
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    _parity(2, 7, 6, 2, 4, 4, True, group=mesh["cp_ulysses"].get_group())
    _parity(1, 9, 5, 5, 4, 4, False, group=mesh["cp_ulysses"])


@pytest.mark.world(1)
def test_single_rank_is_plain_attention():
    _parity(2, 6, 6, 2, 4, 4, True)
    with CommLedger() as ledger:
        q = torch.randn(1, 5, 2, 4, requires_grad=True)
        ulysses_attention(q, q, q, world_group(), causal=False).sum().backward()
    assert ledger.count() == 0


# ---------------------------------------------------------------- ledger


@pytest.mark.world(3)
@pytest.mark.parametrize("dv,per_phase", [(4, 2), (6, 3)])
def test_ledger_exact_counts(dv, per_phase):
    """q, k, v in one all-to-all (a second one for v when Dv != D), one for the output."""
    S, n, n_kv, D = 10, 6, 2, 4
    q, k, v, _ = _inputs(1, S, n, n_kv, D, dv, torch.float64)
    sizes = balanced_split_sizes(S, 3)
    off, n_r = split_offsets(sizes)[rank()], sizes[rank()]
    loc = [t[:, off : off + n_r].clone().requires_grad_() for t in (q, k, v)]
    with CommLedger() as ledger:
        out = ulysses_attention(*loc, world_group(), causal=True, seq_len=S)
        fwd = ledger.count()
        out.sum().backward()
    assert fwd == per_phase
    assert ledger.count(op="all_to_all_single", api="ulysses_attention", phase="forward") == per_phase
    assert ledger.count(op="all_to_all_single", api="ulysses_attention", phase="backward") == per_phase
    assert ledger.count() == 2 * per_phase
    if dv == D:  # bytes of the qkv all-to-all: this rank's heads plus the KV heads each rank needs
        plan = ulysses_head_plan(n, n_kv, 3)
        heads = n + 2 * sum(plan.kv_sizes)
        first = ledger.records[0]
        assert first.bytes_sent == n_r * heads * D * 8


# ---------------------------------------------------------------- head plan (pure)


@settings(deadline=None, max_examples=60)
@given(n_kv=st.integers(1, 12), group=st.integers(1, 6), R=st.integers(1, 9))
def test_head_plan_properties(n_kv, group, R):
    n = n_kv * group
    plan = ulysses_head_plan(n, n_kv, R)
    assert list(plan.q_sizes) == balanced_split_sizes(n, R)
    q0 = 0
    for r in range(R):
        lo, hi = plan.kv_ranges[r]
        # every local query head maps to the KV head of its GQA group, and every received KV head is used
        assert [lo + i for i in plan.kv_index[r]] == [h // group for h in range(q0, q0 + plan.q_sizes[r])]
        assert set(plan.kv_index[r]) == set(range(hi - lo))
        q0 += plan.q_sizes[r]
    assert sum(plan.kv_sizes) <= n_kv + R - 1  # at most one duplicated head per rank boundary
    if n_kv % R == 0:
        assert list(plan.kv_sizes) == balanced_split_sizes(n_kv, R)  # aligned: nothing duplicated


def test_head_plan_example():
    plan = ulysses_head_plan(6, 2, 4)  # query heads [2, 2, 1, 1]; groups {0,1,2} -> kv 0, {3,4,5} -> kv 1
    assert plan.q_sizes == (2, 2, 1, 1) and plan.kv_ranges == ((0, 1), (0, 2), (1, 2), (1, 2))
    with pytest.raises(ShardkitError, match="multiple"):
        ulysses_head_plan(6, 4, 2)


# ---------------------------------------------------------------- local attention helper


@settings(deadline=None, max_examples=40)
@given(sq=st.integers(1, 6), extra=st.integers(0, 4), causal=st.booleans())
def test_attention_with_lse_matches_sdpa(sq, extra, causal):
    sk = sq + extra
    gen = torch.Generator().manual_seed(sq * 10 + extra)
    q, k, v = (torch.randn(2, s, 3, 4, generator=gen, dtype=torch.float64) for s in (sq, sk, sk))
    out, lse = attention_with_lse(q, k, v, causal=causal)
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq) if causal else None
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) / 2.0
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_attention_with_lse_fully_masked_row():
    q = torch.randn(1, 2, 1, 4, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[False, False], [True, True]])
    out, lse = attention_with_lse(q, q, q, causal=False, mask=keep)
    assert torch.isinf(lse[0, 0, 0]) and lse[0, 0, 0] < 0 and torch.all(out[0, 0] == 0)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


# ---------------------------------------------------------------- errors


def _bad_cases():
    g = world_group()
    q = torch.zeros(1, 4, 6, 4)
    kv = torch.zeros(1, 4, 2, 4)
    return {
        "head_dims_differ": (
            ShardkitError,
            "head dims differ",
            lambda: ulysses_attention(q, torch.zeros(1, 4, 2, 3), kv, g, causal=True),
        ),
        "kv_not_dividing": (
            ShardkitError,
            "multiple of the number of KV heads",
            lambda: ulysses_attention(q, torch.zeros(1, 4, 4, 4), torch.zeros(1, 4, 4, 4), g, causal=True),
        ),
        "k_v_heads_differ": (
            ShardkitError,
            "disagree",
            lambda: ulysses_attention(q, kv, torch.zeros(1, 4, 3, 4), g, causal=True),
        ),
        "not_4d": (
            ShardkitError,
            r"\[B, S_local, N, D\]",
            lambda: ulysses_attention(q[0], kv[0], kv[0], g, causal=True),
        ),
        "mixed_dtypes": (ShardkitTypeError, "dtype", lambda: ulysses_attention(q, kv.double(), kv, g, causal=False)),
        "causal_not_bool": (ShardkitTypeError, "causal", lambda: ulysses_attention(q, kv, kv, g, causal=None)),
        "bad_scale": (ShardkitError, "scale", lambda: ulysses_attention(q, kv, kv, g, causal=True, scale=-1.0)),
        "cu_seqlens_wrong_total": (
            ShardkitError,
            "ends at",
            lambda: ulysses_attention(q, kv, kv, g, causal=True, cu_seqlens=[0, 3, 5], seq_len=4 * world_size()),
        ),
        "group_none": (ShardkitTypeError, "group is required", lambda: ulysses_attention(q, kv, kv, None, causal=True)),
    }


@pytest.mark.world(3)
@pytest.mark.parametrize(
    "case",
    [
        "head_dims_differ",
        "kv_not_dividing",
        "k_v_heads_differ",
        "not_4d",
        "mixed_dtypes",
        "causal_not_bool",
        "bad_scale",
        "cu_seqlens_wrong_total",
        "group_none",
    ],
)
def test_bad_input_raises_on_every_rank(case):
    expected_type, fragment, fn = _bad_cases()[case]
    start = time.monotonic()
    with pytest.raises(expected_type, match=fragment) as info:
        fn()
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    outcomes = [None] * world_size()
    dist.all_gather_object(outcomes, (type(info.value).__name__, str(info.value)), group=world_group())
    assert all(o == outcomes[0] for o in outcomes), outcomes  # same type and message everywhere
    t = torch.ones(1)
    dist.all_reduce(t, group=world_group())
    assert t.item() == world_size()
