"""Ring, zigzag and USP attention on CUDA call the fused kernels, never an ``Sq x Sk`` score tensor.

Run on fake CUDA tensors (``harness.fake_cuda``: torch's fake tensors on this CPU build execute
each aten op's meta kernel, fused attention included) as rank 0 of a fake world: every block of
every ring step, forward and backward, must dispatch FlashAttention-2 (bfloat16/float16, unmasked
tiles) or the memory-efficient kernel (float32, or tiles of packed documents, which need a mask),
and no op may return a tensor as large as one block's scores for all heads (``N x tile x tile``
elements: what the math path materializes). float64, which no CUDA kernel takes, keeps the math
path and warns. The numerics of the same code are checked against one process on CPU by the
rest of this folder and on a real GPU by ``scripts/gpu_first_checks.sh``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from harness.fake_cuda import fake_cuda, fake_world, forward_backward
from shardkit.context_parallel import ring, ring_attention, usp_attention

N, N_KV, D = 4, 2, 8  # small heads, long tiles: a tile's scores dwarf every O(S) tensor
TILE = 128  # zigzag chunk of one document: S_doc / (2 R)
FLASH = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}
EFFICIENT = {"_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"}


def _qkv(s_local: int, dtype: torch.dtype):
    q = torch.randn(1, s_local, N, D, device="cuda", dtype=dtype)
    k = torch.randn(1, s_local, N_KV, D, device="cuda", dtype=dtype)
    return q, k, torch.randn_like(k)


def _qkv_cpu(s_local: int):
    return torch.randn(1, s_local, N, D), torch.randn(1, s_local, N_KV, D), torch.randn(1, s_local, N_KV, D)


def _check(log, grads, kernels: set[str], s_local: int):
    fused = {op for op in log.ops if "scaled_dot_product" in op}
    assert fused == kernels, fused
    assert log.ops.count(min(kernels)) > 0 and log.ops.count(max(kernels)) > 0  # forward and backward
    assert grads[-1][0].device.type == "cuda" and [tuple(g.shape) for g in grads[-1][:3]] == [
        (1, s_local, N, D),
        (1, s_local, N_KV, D),
        (1, s_local, N_KV, D),
    ]
    assert log.largest[0] < N * TILE * TILE, f"a score-sized tensor was allocated: {log.largest[1]}"


CASES = [  # (layout, packed, dtype, kernels)
    ("zigzag", False, torch.bfloat16, FLASH),
    ("zigzag", False, torch.float16, FLASH),
    ("contiguous", False, torch.bfloat16, FLASH),
    ("zigzag", False, torch.float32, EFFICIENT),
    ("zigzag", True, torch.bfloat16, FLASH | EFFICIENT),  # cross-document tiles are masked
    ("contiguous", True, torch.float32, EFFICIENT),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("layout", "packed", "dtype", "kernels"), CASES)
def test_ring_blocks_are_fused_on_cuda(monkeypatch, layout, packed, dtype, kernels, causal):
    R = 2
    # Packed: one long document (TILE x TILE tiles, unmasked) and eight short ones, whose zigzag
    # parts share 64-token tiles under a block-diagonal mask.
    S = 8 * TILE
    cu = [0, 4 * TILE, *range(4 * TILE + 64, S + 1, 64)] if packed else None
    s_local = S // R
    grads: list = []
    forward_backward(monkeypatch, ring._RingAttention, grads)
    with fake_world(R) as world:
        # The block plan is host metadata, computed once per layout (and cached) on the CPU; a
        # first call with CPU tensors computes it outside the fake mode, as a real run's first step.
        kw = dict(causal=causal, layout=layout, seq_len=S, cu_seqlens=cu)
        ring_attention(*(t.to("cpu") for t in _qkv_cpu(s_local)), world, **kw)
        with fake_cuda() as log:
            q, k, v = _qkv(s_local, dtype)
            out = ring_attention(q, k, v, world, **kw)
            assert out.device.type == "cuda" and out.shape == q.shape
    _check(log, grads, kernels, s_local)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_usp_ring_blocks_are_fused_on_cuda(monkeypatch, causal):
    grads: list = []
    forward_backward(monkeypatch, ring._RingAttention, grads)
    S = 8 * TILE
    with fake_world(4):
        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("cp_ring", "cp_ulysses"))
        with fake_cuda() as log:
            q, k, v = _qkv(S // 4, torch.bfloat16)
            out = usp_attention(q, k, v, mesh, causal=causal, seq_len=S)
            assert out.device.type == "cuda" and out.shape == q.shape
    assert {op for op in log.ops if "scaled_dot_product" in op} == FLASH
    assert log.largest[0] < (N // 2) * TILE * TILE, log.largest[1]


def test_float64_keeps_the_math_path_and_says_so(monkeypatch):
    forward_backward(monkeypatch, ring._RingAttention, [])
    with fake_world(2) as world, fake_cuda() as log, pytest.warns(UserWarning, match="no fused CUDA kernel"):
        q, k, v = _qkv(2 * TILE, torch.float64)
        ring_attention(q, k, v, world, causal=True, seq_len=4 * TILE)
    assert not any("scaled_dot_product" in op for op in log.ops)
    assert log.largest[0] >= N * TILE * TILE  # the scores: why float64 is for checks, not long runs


def test_window_runs_flash_on_covered_blocks_and_masks_only_the_band(monkeypatch):
    """Zigzag over 2 ranks, chunks of 2 TILE tokens, causal window left = 2 chunks - 1: rank 0's
    chunk 3 sees itself (diagonal) and chunk 2 (fully inside the window) on FlashAttention-2
    without a mask, chunk 1 (partly inside) on the memory-efficient kernel with a mask block,
    and chunk 0 not at all (skipped)."""
    R, S = 2, 8 * TILE
    chunk = S // (2 * R)
    grads: list = []
    forward_backward(monkeypatch, ring._RingAttention, grads)
    counts: Counter = Counter()
    with fake_world(R) as world:
        kw = dict(causal=True, layout="zigzag", seq_len=S, window=(2 * chunk - 1, 0))
        ring_attention(*(t.to("cpu") for t in _qkv_cpu(S // R)), world, **kw)
        with fake_cuda() as log:
            q, k, v = _qkv(S // R, torch.bfloat16)
            ring_attention(q, k, v, world, block_counts=counts, **kw)
    assert {op for op in log.ops if "scaled_dot_product" in op} == FLASH | EFFICIENT
    # forward: 2 diagonals + (3, 2) on flash, (3, 1) masked; (3, 0) and (0, *) later chunks skipped
    assert log.ops.count("_scaled_dot_product_flash_attention") == 3, log.ops
    assert log.ops.count("_scaled_dot_product_efficient_attention") == 1, log.ops
    assert counts["forward"] == 4 and counts["backward"] == 4
    assert log.largest[0] < N * chunk * chunk, log.largest[1]  # no block's scores for all heads


def test_softcap_takes_the_math_path_and_says_so(monkeypatch):
    forward_backward(monkeypatch, ring._RingAttention, [])
    with fake_world(2) as world, fake_cuda() as log, pytest.warns(UserWarning, match="softcap"):
        q, k, v = _qkv(2 * TILE, torch.bfloat16)
        ring_attention(q, k, v, world, causal=True, seq_len=4 * TILE, softcap=30.0)
    assert not any("scaled_dot_product" in op for op in log.ops)
