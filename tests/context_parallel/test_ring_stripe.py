"""ring_attention with ``layout="stripe"`` (rank r holds tokens r, r + R, ...) against eager attention.

Parity in float64 (out, lse, dq, dk, dv) for uneven lengths (S not a multiple of R, so the ranks
hold different counts), grouped-query heads, causal and not, with a softcap; one block per step
on every rank (the balance Striped Attention is for); refusals of packed documents and windows.
"""

from collections import Counter

import pytest
import torch

from harness.attention import check_variant_parity, problem
from harness.helpers import rank, world_group, world_size
from shardkit import ShardkitError
from shardkit.context_parallel import apply_cp, ring_attention, ring_chunks
from shardkit.context_parallel._ring_plan import rank_work


@pytest.mark.world(2)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S", [16, 13, 3])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_stripe_r2(causal, S, softcap):
    idx = torch.arange(rank(), S, world_size())

    def run(q, k, v):
        return ring_attention(q, k, v, world_group(), causal=causal, layout="stripe", softcap=softcap, return_lse=True)

    check_variant_parity(run, idx, (2, S, 6, 2, 8), causal, None, softcap)


@pytest.mark.world(3)
@pytest.mark.parametrize("causal", [True, False])
def test_stripe_r3_uneven_counts(causal):
    S, R, r = 17, world_size(), rank()  # ranks hold 6, 6, 5 tokens
    idx = torch.arange(r, S, R)
    counts = Counter()

    def run(q, k, v):
        return ring_attention(
            q, k, v, world_group(), causal=causal, layout="stripe", seq_len=S, block_counts=counts, return_lse=True
        )

    check_variant_parity(run, idx, (1, S, 4, 4, 4), causal, None, None)
    assert counts["forward"] == R and counts["backward"] == R  # one block per step, every rank


@pytest.mark.world(2)
def test_stripe_refusals():
    q = torch.zeros(1, 4, 2, 4, dtype=torch.float64)
    g = world_group()
    with pytest.raises(ShardkitError, match="stripe layout takes one sequence"):
        ring_attention(q, q, q, g, causal=True, layout="stripe", cu_seqlens=(0, 3, 8))
    with pytest.raises(ShardkitError, match="stripe layout takes one sequence"):
        ring_attention(q, q, q, g, causal=True, layout="stripe", seq_len=8, window=(2, 0))
    with pytest.raises(ShardkitError, match="the ranks hold"):  # 4 + 4 is not the stripe split of 9
        ring_attention(
            torch.zeros(1, 4 + rank(), 2, 4), *[torch.zeros(1, 4 + rank(), 2, 4)] * 2, g, causal=True, layout="stripe"
        )
    with pytest.raises(ShardkitError, match="ring_layout must be"):  # the other modes keep their own
        apply_cp(torch.nn.Linear(1, 1), g, "ulysses", ring_layout="stripe")
    with pytest.raises(ShardkitError, match="ring_layout must be"):
        apply_cp(torch.nn.Linear(1, 1), g, "ring", ring_layout="llama")
    with pytest.raises(ShardkitError, match="no chunks"):
        ring_chunks("stripe", 8, 2, 0)
    out = ring_attention(*(t[:, rank() :: 2] for t in problem(1, 8, 2, 2, 4)[:3]), g, causal=True, layout="stripe")
    assert out.shape == (1, 4, 2, 4)


@pytest.mark.parametrize("R", [2, 4])
def test_causal_load_balance_of_the_layouts(R):
    """Every layout's blocks cover each visible pair exactly once (the causal total), and the
    balance (max / mean work) is what each layout is for: zigzag and stripe within a row or two
    of even, contiguous with its last rank doing (2R - 1) / R of the mean."""
    S = 64 * R
    total = S * (S + 1) // 2
    work = {layout: rank_work(layout, (0, S), R) for layout in ("zigzag", "contiguous", "stripe")}
    for layout, w in work.items():
        assert sum(w) == total, (layout, w)
    mean = total / R
    assert max(work["zigzag"]) / mean == pytest.approx(1.0, abs=1e-12)  # chunks pair up exactly
    assert max(work["stripe"]) / mean < 1 + 2 * R / S  # rank R - 1 sees one more key per row
    assert max(work["contiguous"]) / mean == pytest.approx((2 * R - 1) / R, rel=2 / S)
    # a packed sequence keeps the totals: documents never attend across
    cu = (0, 5, 5, 40, S)
    docs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu[:-1], cu[1:]))
    assert sum(rank_work("zigzag", cu, R)) == docs == sum(rank_work("contiguous", cu, R))
