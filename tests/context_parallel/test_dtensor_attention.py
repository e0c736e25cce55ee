"""DTensor in, DTensor out for ring / Ulysses / USP attention (issue 34 item 5).

Parity of the DTensor path against the one-process reference and the plain-tensor path (output,
dq, dk, dv; float64; uneven sizes), the output's placements and global shape, no copy of the
local tensors, and the errors: wrong placements, a mesh that is not the group, mixed inputs,
layouts a DTensor cannot express.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.attention import reference_attention
from harness.helpers import get_mesh
from shardkit import CommLedger, ShardkitError, ShardkitTypeError
from shardkit._shapes import balanced_split_sizes, chunk_sizes, split_offsets
from shardkit.context_parallel import ring_attention, ulysses_attention, usp_attention
from shardkit.context_parallel._dtensor import attention_dtensor


def _problem(B, S, n, n_kv, D, seed=5):
    gen = torch.Generator().manual_seed(seed)  # the same full problem on every rank
    shapes = ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, D), (B, S, n, D))
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]


def _block(n: int, parts: int, i: int) -> slice:
    """Block ``i`` of the torch.chunk split of ``n`` over ``parts`` (DTensor's Shard rule)."""
    sizes = chunk_sizes(n, parts)
    off = split_offsets(sizes)[i]
    return slice(off, off + sizes[i])


def _dt(local, mesh, placements, full):
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _run(fn, group, mesh, placements, rows, cols, B, S, causal, **kw):
    """Run ``fn`` on DTensors and on the same local tensors as plain tensors; check both against
    the reference (output and gradients) and the DTensor output's placements and shape."""
    q, k, v, w = _problem(B, S, 4, 2, 3)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*ref, causal)
    (out_ref * w).sum().backward()
    loc = [t[rows, cols].clone().requires_grad_() for t in (q, k, v)]
    with CommLedger() as ledger:
        out = fn(*[_dt(x, mesh, placements, t) for x, t in zip(loc, (q, k, v))], group, causal=causal, **kw)
    # S comes from the DTensor: a size all-gather only where the chunk split is not the balanced one
    balanced = [chunk_sizes(S, n) == balanced_split_sizes(S, n) for n in mesh.shape if n > 1]
    assert ledger.count(phase="metadata") == (0 if all(balanced) else 1)
    assert isinstance(out, DTensor)
    assert tuple(out.placements) == tuple(placements) and out.device_mesh == mesh
    assert out.shape == (B, S, 4, 3)
    (out.to_local() * w[rows, cols]).sum().backward()
    plain = [t[rows, cols].clone().requires_grad_() for t in (q, k, v)]
    if kw.get("layout") is None and fn is not usp_attention:  # the plain path with the same split
        out_plain = fn(*plain, group, causal=causal, **kw)
        (out_plain * w[rows, cols]).sum().backward()
        torch.testing.assert_close(out.to_local(), out_plain, rtol=0, atol=0)
        for a, b in zip(loc, plain):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out.to_local()] + [t.grad for t in loc], [out_ref] + ref):
        want = want if name == "out" else want.grad
        torch.testing.assert_close(got, want[rows, cols], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.world(3)
@pytest.mark.parametrize("S", [7, 9])  # 7 over 3: chunk [3, 3, 1] is not balanced (learned split); 9: even
@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_dtensor_parity(S, causal):
    mesh = get_mesh((3,), ("cp",))
    r = mesh.get_local_rank()
    _run(ulysses_attention, mesh, mesh, [Shard(1)], slice(None), _block(S, 3, r), 2, S, causal)


@pytest.mark.world(3)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_contiguous_dtensor_parity(causal):
    mesh = get_mesh((3,), ("cp",))
    S = 5  # uneven: chunk [2, 2, 1] is the balanced split too
    _run(ring_attention, mesh, mesh, [Shard(1)], slice(None), _block(S, 3, mesh.get_local_rank()), 1, S, causal,
         layout="contiguous")  # fmt: skip


@pytest.mark.world(4)
def test_dp_by_cp_mesh_batch_sharded():
    """A DTensor on a (dp, cp) mesh: Shard(0) over dp (uneven batch), Shard(1) over cp."""
    mesh = get_mesh((2, 2), ("dp", "cp"))
    i, j = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    _run(ulysses_attention, mesh["cp"], mesh, [Shard(0), Shard(1)], _block(3, 2, i), _block(5, 2, j), 3, 5, True)


@pytest.mark.world(2)
def test_usp_dtensor_one_ring_rank():
    mesh = get_mesh((1, 2), ("cp_ring", "cp_ulysses"))
    j = mesh["cp_ulysses"].get_local_rank()
    _run(usp_attention, mesh, mesh, [Shard(1), Shard(1)], slice(None), _block(5, 2, j), 1, 5, True)


@pytest.mark.world(2)
def test_lse_is_a_dtensor_and_no_copy():
    mesh = get_mesh((2,), ("cp",))
    q, k, v, _ = _problem(1, 5, 4, 2, 3)
    cols = _block(5, 2, mesh.get_local_rank())
    loc = [t[:, cols].clone() for t in (q, k, v)]
    seen = []

    def spy(*args, **kw):
        seen.extend(a.data_ptr() for a in args[:3])
        return ulysses_attention(*args, **kw)

    dts = [_dt(x, mesh, [Shard(1)], t) for x, t in zip(loc, (q, k, v))]
    kw = dict(causal=True, scale=None, cu_seqlens=None, seq_len=None, return_lse=True)
    out, lse = attention_dtensor(spy, "ulysses_attention", *dts, mesh, kw)
    assert seen == [x.data_ptr() for x in loc]  # the local tensors themselves reached the plain path
    assert isinstance(lse, DTensor) and lse.shape == (1, 5, 4) and tuple(lse.placements) == (Shard(1),)
    _, lse_plain = ulysses_attention(*loc, mesh, causal=True, return_lse=True)
    torch.testing.assert_close(lse.to_local(), lse_plain, rtol=0, atol=0)


def _errors(mesh, group, placements, S=6, **kw):
    q, k, v, _ = _problem(1, S, 4, 2, 3)
    r = mesh.get_local_rank() if mesh.ndim == 1 else 0
    dts = [_dt(t[:, _block(S, mesh.size(), r)].clone(), mesh, placements, t) for t in (q, k, v)]
    return dts, group


@pytest.mark.world(2)
@pytest.mark.parametrize("bad", [[Replicate()], [Partial()], [Shard(2)]])
def test_wrong_placement_raises_on_every_rank(bad):
    mesh = get_mesh((2,), ("cp",))
    (q, k, v), g = _errors(mesh, mesh, bad)
    with pytest.raises(ShardkitError, match="must be Shard\\(1\\)"):
        ulysses_attention(q, k, v, g, causal=True)
    with pytest.raises(ShardkitError, match="must be Shard\\(1\\)"):
        ring_attention(q, k, v, g, causal=True, layout="contiguous")


@pytest.mark.world(2)
def test_mixed_and_layout_errors():
    mesh = get_mesh((2,), ("cp",))
    (q, k, v), g = _errors(mesh, mesh, [Shard(1)])
    with pytest.raises(ShardkitTypeError, match="q, v are DTensors but k is not"):
        ulysses_attention(q, k.to_local(), v, g, causal=True)
    with pytest.raises(ShardkitError, match="contiguous split"):
        ring_attention(q, k, v, g, causal=True)  # zigzag by default
    with pytest.raises(ShardkitError, match="global sequence length is 6"):
        ulysses_attention(q, k, v, g, causal=True, seq_len=8)
    k_rep = k.redistribute(mesh, [Replicate()])  # a collective: every rank takes it
    with pytest.raises(ShardkitError, match="must match"):
        ulysses_attention(q, k_rep, v, g, causal=True)


@pytest.mark.world(3)
def test_ring_uneven_chunk_not_balanced_raises():
    mesh = get_mesh((3,), ("cp",))
    (q, k, v), g = _errors(mesh, mesh, [Shard(1)], S=7)  # chunk [3, 3, 1] vs balanced [3, 2, 2]
    with pytest.raises(ShardkitError, match="balanced split"):
        ring_attention(q, k, v, g, causal=True, layout="contiguous")


@pytest.mark.world(4)
def test_mesh_not_the_group_and_usp_ring_raise():
    flat = get_mesh((4,), ("cp",))
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    (q, k, v), _ = _errors(flat, flat, [Shard(1)], S=8)
    with pytest.raises(ShardkitError, match="no dim whose group"):
        ulysses_attention(q, k, v, mesh["cp_ulysses"], causal=True)
    qs = _problem(1, 8, 4, 2, 3)[:3]
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    rows = _block(8, 2, i)
    dts = [_dt(t[:, rows][:, _block(4, 2, j)].clone(), mesh, [Shard(1), Shard(1)], t) for t in qs]
    with pytest.raises(ShardkitError, match="zigzag"):
        usp_attention(*dts, mesh, causal=True)
