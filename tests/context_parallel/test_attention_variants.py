"""Sliding window, logit softcap and returned lse in every context-parallel layout, against eager attention.

Parity (docs/design.md, Testing): float64, the full problem built identically on every rank, each
rank's output, lse and dq/dk/dv compared with its rows of one-process eager attention with the
same options (``harness.attention.variant_attention``, which builds its mask from positions and
never touches shardkit's block plan). Uneven lengths (S not a multiple of 2R), grouped-query
heads, packed documents with empty and short documents, windows narrower and wider than a chunk.
"""

from collections import Counter

import pytest
import torch

from harness.attention import check_variant_parity as check
from harness.attention import problem as _problem
from harness.helpers import get_mesh, rank, world_group, world_size
from shardkit import ShardkitError, ShardkitTypeError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.context_parallel import (
    packed_indices,
    ring_attention,
    ulysses_attention,
    usp_attention,
    usp_indices,
    zigzag_positions,
)
from shardkit.context_parallel._ring_plan import block_plan


def _block(S, R, r):
    sizes = balanced_split_sizes(S, R)
    off = split_offsets(sizes)[r]
    return torch.arange(off, off + sizes[r])


# (window, softcap): a window narrower than a chunk (out-of-window chunk pairs skipped), one
# wider than a chunk, a two-sided one (right bound used without causal masking), HF's
# sliding_window given as W, and a softcap alone and with a window.
VARIANTS = [
    ((2, 1), None),
    ((7, 3), None),
    ((-1, 2), None),
    ("W=4", None),
    (None, 1.5),
    ((3, 0), 2.0),
]


def _kwargs(window, softcap):
    if window == "W=4":
        return dict(sliding_window=4, softcap=softcap), (3, 3)
    return dict(window=window, softcap=softcap), window


@pytest.mark.world(2)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 13, 4, 2, 8), (1, 16, 3, 3, 4)])
def test_ring_r2(shape, causal, layout, variant):
    R, r = world_size(), rank()
    kw, window = _kwargs(*variant)
    S = shape[1]
    idx = zigzag_positions(S, R, r) if layout == "zigzag" else _block(S, R, r)

    def run(q, k, v):
        return ring_attention(q, k, v, world_group(), causal=causal, layout=layout, return_lse=True, **kw)

    check(run, idx, shape, causal, window, variant[1])


@pytest.mark.world(3)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("variant", [((4, 0), None), ((5, 2), 3.0)])
def test_ring_r3_uneven_gqa(layout, variant):
    R, r = world_size(), rank()
    S, causal = 17, variant[0][1] == 0
    idx = zigzag_positions(S, R, r) if layout == "zigzag" else _block(S, R, r)
    kw, window = _kwargs(*variant)

    def run(q, k, v):  # seq_len left out: learned with the metadata all-gather
        return ring_attention(q, k, v, world_group(), causal=causal, layout=layout, return_lse=True, **kw)

    check(run, idx, (1, S, 6, 2, 4), causal, window, variant[1])


# Packed documents: an empty document, short ones that share a tile, one longer than the window.
DOCS = [(0, 3, 3, 9, 10, 23), (0, 23)]


@pytest.mark.world(2)
@pytest.mark.parametrize("cu", DOCS)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("variant", [((3, 0), None), ((2, 2), 2.0), (None, 1.0)])
def test_ring_packed(cu, layout, variant):
    R, r = world_size(), rank()
    causal = variant[0] is None or variant[0][1] == 0
    idx = packed_indices(cu, R, r) if layout == "zigzag" else _block(cu[-1], R, r)
    kw, window = _kwargs(*variant)

    def run(q, k, v):
        return ring_attention(
            q, k, v, world_group(), causal=causal, layout=layout, cu_seqlens=cu, return_lse=True, **kw
        )

    check(run, idx, (1, cu[-1], 4, 2, 8), causal, window, variant[1], cu=cu)


@pytest.mark.world(2)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cu", [None, (0, 5, 5, 13)])
def test_ulysses_r2(variant, causal, cu):
    R, r = world_size(), rank()
    kw, window = _kwargs(*variant)
    idx = _block(13, R, r)

    def run(q, k, v):
        return ulysses_attention(q, k, v, world_group(), causal=causal, cu_seqlens=cu, return_lse=True, **kw)

    check(run, idx, (2, 13, 4, 2, 8), causal, window, variant[1], cu=cu)


@pytest.mark.world(3)
@pytest.mark.parametrize("variant", [((2, 0), None), ((3, 1), 2.5)])
def test_ulysses_r3_heads_uneven(variant):
    R, r = world_size(), rank()
    kw, window = _kwargs(*variant)
    causal = variant[0][1] == 0

    def run(q, k, v):  # 4 query heads over 3 ranks, a KV group straddling a rank boundary
        return ulysses_attention(q, k, v, world_group(), causal=causal, seq_len=11, return_lse=True, **kw)

    check(run, _block(11, R, r), (1, 11, 4, 2, 4), causal, window, variant[1])


@pytest.mark.world(4)
@pytest.mark.parametrize("variant", [((3, 0), None), ((2, 4), 2.0), (None, 1.5)])
@pytest.mark.parametrize("cu", [None, (0, 7, 7, 19)])
def test_usp_2x2(variant, cu):
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    S = 19
    idx = usp_indices(cu or (0, S), 2, 2, i, j)
    causal = variant[0] is None or variant[0][1] == 0
    kw, window = _kwargs(*variant)

    def run(q, k, v):
        return usp_attention(q, k, v, mesh, causal=causal, seq_len=S, cu_seqlens=cu, return_lse=True, **kw)

    check(run, idx, (1, S, 6, 2, 4), causal, window, variant[1], cu=cu)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_out_of_window_blocks_are_skipped(layout):
    """Contiguous, window < one rank's block: rank r computes only its own block and its
    predecessor's (1 on rank 0); zigzag: the pairs within ``left`` tokens of each other."""
    R, r, S = world_size(), rank(), 32  # chunks of 4 (zigzag) or blocks of 8 (contiguous)
    idx = zigzag_positions(S, R, r) if layout == "zigzag" else _block(S, R, r)
    counts = Counter()

    def run(q, k, v):
        return ring_attention(
            q, k, v, world_group(), causal=True, layout=layout, window=(3, 0), block_counts=counts, return_lse=True
        )

    check(run, idx, (1, S, 2, 2, 4), True, (3, 0))
    if layout == "contiguous":
        expected = 1 if r == 0 else 2
    else:  # chunk c sees itself and chunk c - 1 (left 3 < chunk length 4); rank r holds r and 7 - r
        mine = {r, 2 * R - 1 - r}
        expected = sum(1 for c in mine for d in range(2 * R) if d in (c, c - 1))
    assert counts["forward"] == expected and counts["backward"] == expected, (counts, expected)
    unwindowed = Counter()
    ring_attention(
        *(t[:, idx] for t in _problem(1, S, 2, 2, 4)[:3]),
        world_group(),
        causal=True,
        layout=layout,
        block_counts=unwindowed,
    )
    assert unwindowed["forward"] >= expected


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(window=(2,)), ShardkitError, "window must be"),
        (dict(window=(-2, 0)), ShardkitError, "window must be"),
        (dict(window=(2, 0), sliding_window=3), ShardkitError, "not both"),
        (dict(sliding_window=0), ShardkitError, "sliding_window must be"),
        (dict(softcap=-1.0), ShardkitError, "softcap must be"),
        (dict(softcap="1"), ShardkitTypeError, "softcap must be"),
        (dict(return_lse=1), ShardkitTypeError, "return_lse must be"),
    ],
)
def test_bad_variant_raises_on_every_rank(kwargs, error, match):
    q = torch.zeros(1, 4, 2, 4, dtype=torch.float64)
    for fn in (ring_attention, ulysses_attention):
        with pytest.raises(error, match=match):
            fn(q, q, q, world_group(), causal=True, seq_len=8, **kwargs)
    with pytest.raises(error, match=match):
        usp_attention(q, q, q, get_mesh((2, 1), ("cp_ring", "cp_ulysses")), causal=True, seq_len=8, **kwargs)


def test_window_plan_masks_only_partly_covered_blocks():
    """Zigzag over 4 ranks, S = 32 (chunks of 4), causal, left = 7: a chunk against itself is the
    causal diagonal (no mask), against the chunk before it fully inside the window (no mask),
    two chunks back partly covered (a mask block), three or more back skipped."""
    kinds = Counter()
    for q_rank in range(4):
        for kv_rank in range(4):
            for b in block_plan("zigzag", (0, 32), 4, q_rank, kv_rank, True, 0, (7, 0)):
                assert (b.mask is None) == (b.kind != "mask")
                kinds[b.kind, b.q_n, b.k_n] += 1
                if b.kind == "mask":  # the band of keys q - 7 <= k, cropped to rows that see any
                    assert not bool(b.mask.all()) and bool(b.mask.any(1).all())
    # 8 chunks: 8 diagonals, 7 (c, c - 1) pairs, 6 (c, c - 2) pairs, nothing further back
    assert kinds == Counter({("diag", 4, 4): 8, ("full", 4, 4): 7, ("mask", 3, 3): 6}), kinds
