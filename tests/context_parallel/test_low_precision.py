"""bfloat16 ring, Ulysses and USP attention at R = 4 against a float64 reference.

The reference takes the *same* bf16-rounded inputs in float64, so the only errors left are the
parallel op's own: bf16 kernels and bf16 outputs, with partial results merged in float32. The
bound is about three bf16 roundings (relative Frobenius error): an op that merged its ring
steps (or accumulated dK/dV) in bf16 instead of float32 misses it (checked by injecting that
one-line mutation into ring.py by hand; see the issue note).
"""

import pytest
import torch

from harness.attention import reference_attention
from harness.helpers import get_mesh, rank, world_group
from shardkit._shapes import split_offsets
from shardkit.context_parallel import ring_attention, ulysses_attention, usp_attention, usp_indices, zigzag_positions

# ||err|| / ||ref|| (Frobenius) of out, dq, dk, dv. Measured at R = 4 (ring, this problem):
# float32 merges 1.7e-3 .. 6.3e-3 (single-device bf16 SDPA: 1.7e-3 .. 4.6e-3); the bf16-merge
# mutation 1.7e-2 .. 2.8e-2 on dq, dk, dv on every rank.
BOUND = 1e-2
B, S, N, N_KV, D = 2, 64, 4, 2, 16


def _errors(fn, pos, causal=True):
    """Relative errors of out, dq, dk, dv of ``fn`` on this rank's tokens ``pos``."""
    gen = torch.Generator().manual_seed(11)
    full = [
        (torch.randn(*s, generator=gen, dtype=torch.float64) * 2).to(torch.bfloat16)
        for s in ((B, S, N, D), (B, S, N_KV, D), (B, S, N_KV, D), (B, S, N, D))
    ]
    ref = [t.double().requires_grad_() for t in full[:3]]
    out_ref = reference_attention(*ref, causal)
    (out_ref * full[3].double()).sum().backward()
    loc = [t[:, pos].clone().requires_grad_() for t in full[:3]]
    out = fn(*loc)
    (out * full[3][:, pos]).sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in loc)
    errs = []
    for got, want in zip([out] + [t.grad for t in loc], [out_ref] + [t.grad for t in ref]):
        want = want[:, pos]
        errs.append(float((got.detach().double() - want.detach()).norm() / want.detach().norm()))
    return errs


def _contiguous(S, R, r):
    sizes = [S // R] * R
    return torch.arange(split_offsets(sizes)[r], split_offsets(sizes)[r] + sizes[r])


@pytest.mark.world(4)
def test_ring_bf16_r4():
    errs = _errors(
        lambda q, k, v: ring_attention(q, k, v, world_group(), causal=True, seq_len=S), zigzag_positions(S, 4, rank())
    )
    assert max(errs) < BOUND, errs


@pytest.mark.world(4)
def test_ulysses_bf16_r4():
    errs = _errors(
        lambda q, k, v: ulysses_attention(q, k, v, world_group(), causal=True, seq_len=S), _contiguous(S, 4, rank())
    )
    assert max(errs) < BOUND, errs


@pytest.mark.world(4)
def test_usp_bf16_2x2():
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    pos = usp_indices([0, S], 2, 2, mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank())
    errs = _errors(lambda q, k, v: usp_attention(q, k, v, mesh, causal=True, seq_len=S), pos)
    assert max(errs) < BOUND, errs
