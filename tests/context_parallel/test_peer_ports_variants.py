"""Our own ports of the peers' context-parallel attention tests, with their window / softcap arguments set.

The peers' public suites call their attention with ``window_size=(left, right)`` and ``softcap``
(flash-attn's arguments) and compare the distributed result with one-process attention; they run
them at the defaults (``window_size=(-1, -1)``, ``softcap=0.0``). Each port below keeps the
peer's case (the layout, the lengths and head counts scaled down 8x for 2 CPU cores, which
quantities are compared) and runs it at the default and at windows and caps that bite. Written
from the facts of those tests, not their code:

* ring-flash-attn ``test/test_ring_flash_attn_func.py``: contiguous ring, ``S = 3816``, 5 heads,
  ``D = 128``, causal; out, lse (theirs ``[B, N, S]``, ours ``[B, S, N]``), dq, dk, dv.
* ring-flash-attn ``test/test_zigzag_ring_flash_attn_func.py``: zigzag ring, ``S = 3824``, the same.
* ring-flash-attn ``test/test_stripe_flash_attn_func.py``: stripe layout (rank ``r`` holds tokens
  ``r, r + R, ...``), ``S = 3824``, the same quantities; windows are refused by the stripe layout,
  so it runs at the default window with and without a cap.
* ring-flash-attn ``test/test_zigzag_ring_flash_attn_varlen_func.py``: packed documents
  ``cu_seqlens = [0, 120, 1248, 4232]``, zigzag per document, 5 heads, causal.
* ring-flash-attn ``test/test_llama3_flash_attn_varlen_func.py``: Llama 3's layout, rank ``r``
  holding the contiguous slice ``r`` of the packed sequence (documents cut where the slice
  falls), ``cu_seqlens = [0, 120, 1248, 4232]``, 5 heads, ``D = 8``, causal; out, lse, dq, dk,
  dv. In shardkit that placement is ``ring_attention(layout="contiguous", cu_seqlens=...)``
  (the KV blocks travel the ring, cross-document pairs skipped, instead of one all-gather).
* yunchang ``test/test_hybrid_attn.py``: USP (Ulysses x zigzag ring), ``S = 1024``, 32 heads,
  ``D = 40``, causal and not; out, dq, dk, dv (its "basic" ring is not a USP layout of shardkit).
* yunchang ``test/test_ulysses_attn.py``: Ulysses alone, causal and not.

Float64 here instead of the peers' bfloat16, so the tolerance is rounding (rtol 1e-9), not 1e-2.
"""

import pytest
import torch

from harness.attention import check_variant_parity
from harness.helpers import get_mesh, rank, world_group, world_size
from shardkit import balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.context_parallel import (
    packed_indices,
    ring_attention,
    ulysses_attention,
    usp_attention,
    usp_indices,
    zigzag_positions,
)

# The peers' default first, then windows narrower and wider than a rank's share, a cap alone and
# a window with a cap (Gemma 2 ships a cap of 50 on scores of this size: 1.0 here so that it bites).
WINDOWS = [((-1, -1), 0.0), ((31, 0), 0.0), ((200, 0), 0.0), ((-1, -1), 1.0), ((15, 0), 1.0)]


def _block(S, R, r):
    sizes = balanced_split_sizes(S, R)
    return torch.arange(split_offsets(sizes)[r], split_offsets(sizes)[r] + sizes[r])


def _ring_case(S, layout, window, softcap, cu=None):
    R, r = world_size(), rank()
    if cu is not None:
        idx = packed_indices(cu, R, r)
    elif layout == "stripe":
        idx = torch.arange(r, S, R)
    else:
        idx = zigzag_positions(S, R, r) if layout == "zigzag" else _block(S, R, r)

    def run(q, k, v):
        return ring_attention(
            q,
            k,
            v,
            world_group(),
            causal=True,
            layout=layout,
            cu_seqlens=cu,
            window=window,
            softcap=softcap,
            return_lse=True,
        )

    check_variant_parity(run, idx, (1, S, 5, 5, 16), True, window, softcap, cu=cu)


@pytest.mark.world(2)
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_ring_flash_attn_func(window, softcap):
    _ring_case(3816 // 8, "contiguous", window, softcap)


@pytest.mark.world(2)
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_zigzag_ring_flash_attn_func(window, softcap):
    _ring_case(3824 // 8, "zigzag", window, softcap)


@pytest.mark.world(2)
@pytest.mark.parametrize("softcap", [0.0, 1.0])
def test_stripe_flash_attn_func(softcap):
    _ring_case(3824 // 8, "stripe", (-1, -1), softcap)


@pytest.mark.world(2)
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_zigzag_ring_flash_attn_varlen_func(window, softcap):
    cu = tuple(x // 8 for x in (0, 120, 1248, 4232))
    _ring_case(cu[-1], "zigzag", window, softcap, cu=cu)


@pytest.mark.world(2)
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_llama3_flash_attn_varlen_func(window, softcap):
    cu = tuple(x // 8 for x in (0, 120, 1248, 4232))
    R, r = world_size(), rank()

    def run(q, k, v):
        return ring_attention(
            q,
            k,
            v,
            world_group(),
            causal=True,
            layout="contiguous",
            cu_seqlens=cu,
            window=window,
            softcap=softcap,
            return_lse=True,
        )

    check_variant_parity(run, _block(cu[-1], R, r), (1, cu[-1], 5, 5, 8), True, window, softcap, cu=cu)


@pytest.mark.world(4)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_yunchang_hybrid_attn(causal, window, softcap):
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    S = 1024 // 8
    window = window if causal or window == (-1, -1) else (window[0], window[0] // 2)  # two-sided without causal

    def run(q, k, v):
        return usp_attention(q, k, v, mesh, causal=causal, seq_len=S, window=window, softcap=softcap, return_lse=True)

    check_variant_parity(
        run, usp_indices((0, S), 2, 2, i, j), (1, S, 32 // 4, 32 // 4, 40 // 5), causal, window, softcap
    )


@pytest.mark.world(2)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_yunchang_ulysses_attn(causal, window, softcap):
    S = 1024 // 8
    window = window if causal or window == (-1, -1) else (window[0], window[0] // 2)

    def run(q, k, v):
        return ulysses_attention(
            q, k, v, world_group(), causal=causal, seq_len=S, window=window, softcap=softcap, return_lse=True
        )

    check_variant_parity(run, _block(S, world_size(), rank()), (1, S, 8, 8, 8), causal, window, softcap)
