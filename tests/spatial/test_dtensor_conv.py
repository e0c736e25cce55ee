"""DTensor in, DTensor out for apply_spatial's (transposed) convolutions (issue 34 item 5).

Parity against the one-process layer and the plain local path (output, input and weight
gradients; float64; uneven splits; tiles), the output's placements and global shape, no copy of
the local tensor, and the errors: wrong placements, a mesh that is not the group, an output
split a DTensor Shard cannot hold, ``sizes=`` beside a DTensor.
"""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.helpers import get_mesh
from shardkit import CommLedger, ShardkitError, apply_spatial
from shardkit._shapes import chunk_sizes, split_offsets
from shardkit.comm._dtensor import local_of


def _block(n: int, parts: int, i: int) -> slice:
    sizes = chunk_sizes(n, parts)
    return slice(split_offsets(sizes)[i], split_offsets(sizes)[i] + sizes[i])


def _dt(local, mesh, placements, full):
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _layer(kind, seed=3):
    torch.manual_seed(seed)
    if kind == "conv":
        return nn.Conv2d(2, 3, 3, padding=1).double()
    if kind == "strided":
        return nn.Conv2d(2, 3, 3, stride=2, padding=1).double()
    return nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1).double()


def _parity(kind, mesh, groups, dims, placements, blocks, shape=(2, 2, 7, 5)):
    """``blocks(n_h, n_w)``: this rank's (rows, cols) of an ``[.., n_h, n_w]`` frame."""
    ref = _layer(kind)
    layer = apply_spatial(copy.deepcopy(ref), groups, dims)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    (y_ref * w).sum().backward()
    rows, cols = blocks(*x.shape[2:])
    loc = x[:, :, rows, cols].clone().requires_grad_()
    with CommLedger() as ledger:
        y = layer(_dt(loc, mesh, placements, x))
    assert ledger.count(phase="metadata") == 0  # the split comes from the DTensor, not an all-gather
    assert isinstance(y, DTensor) and tuple(y.placements) == tuple(placements) and y.device_mesh == mesh
    assert y.shape == y_ref.shape
    orow, ocol = blocks(*y_ref.shape[2:])
    (y.to_local() * w[:, :, orow, ocol]).sum().backward()
    torch.testing.assert_close(y.to_local(), y_ref[:, :, orow, ocol].detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(loc.grad, xr.grad[:, :, rows, cols], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=1e-9, atol=1e-12)
    # the plain local path with the same split gives the same numbers, bit for bit
    plain = loc.detach().clone()
    torch.testing.assert_close(apply_spatial(copy.deepcopy(ref), groups, dims)(plain), y.to_local(), rtol=0, atol=0)


@pytest.mark.world(3)
@pytest.mark.parametrize("kind", ["conv", "transpose"])
def test_one_dim_uneven(kind):
    mesh = get_mesh((3,), ("sp",))
    r = mesh.get_local_rank()
    # conv: H = 7 over 3, [3, 3, 1]; transposed: H = 6 (x2 keeps the chunk split only when even)
    shape = (2, 2, 7, 5) if kind == "conv" else (2, 2, 6, 5)
    _parity(kind, mesh, mesh, 2, [Shard(2)], lambda h, w: (_block(h, 3, r), slice(None)), shape)


@pytest.mark.world(2)
def test_strided_conv_width():
    mesh = get_mesh((2,), ("sp",))
    r = mesh.get_local_rank()
    _parity("strided", mesh, mesh, 3, [Shard(3)], lambda h, w: (slice(None), _block(w, 2, r)))


@pytest.mark.world(4)
def test_tiles_h_by_w():
    mesh = get_mesh((2, 2), ("h", "w"))
    i, j = mesh["h"].get_local_rank(), mesh["w"].get_local_rank()
    _parity("conv", mesh, mesh, (2, 3), [Shard(2), Shard(3)], lambda h, w: (_block(h, 2, i), _block(w, 2, j)))


@pytest.mark.world(2)
def test_local_tensor_is_not_copied():
    mesh = get_mesh((2,), ("sp",))
    x = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    loc = x[:, :, _block(6, 2, mesh.get_local_rank())].clone()
    assert local_of(_dt(loc, mesh, [Shard(2)], x)).data_ptr() == loc.data_ptr()


def _bad_call(mesh, group, placements, layer_kind="conv", H=6, sizes=None):
    layer = apply_spatial(_layer(layer_kind), group, 2)
    x = torch.randn(1, 2, H, 4, dtype=torch.float64)
    r = mesh.get_local_rank() if mesh.ndim == 1 else 0
    return layer(_dt(x[:, :, _block(H, mesh.size(), r)].clone(), mesh, placements, x), sizes=sizes)


@pytest.mark.world(2)
@pytest.mark.parametrize("bad", [Replicate(), Partial(), Shard(3)])
def test_wrong_placement_raises(bad):
    mesh = get_mesh((2,), ("sp",))
    with pytest.raises(ShardkitError, match="must be Shard\\(2\\)"):
        _bad_call(mesh, mesh, [bad])


@pytest.mark.world(2)
def test_sizes_with_a_dtensor_raises():
    mesh = get_mesh((2,), ("sp",))
    with pytest.raises(ShardkitError, match="pass no sizes="):
        _bad_call(mesh, mesh, [Shard(2)], sizes=[3, 3])


@pytest.mark.world(3)
@pytest.mark.parametrize("kind", ["strided", "transpose"])
def test_output_split_not_a_chunk_split_raises(kind):
    # H = 7 over 3 ([3, 3, 1]); strided (k 3, s 2, p 1): window-centre [2, 1, 1] vs chunk [2, 2, 0];
    # transposed (x2): [6, 6, 2] vs chunk [5, 5, 4]
    mesh = get_mesh((3,), ("sp",))
    with pytest.raises(ShardkitError, match="not the torch.chunk split"):
        _bad_call(mesh, mesh, [Shard(2)], layer_kind=kind, H=7)


@pytest.mark.world(4)
def test_mesh_not_the_group_raises():
    flat, mesh = get_mesh((4,), ("sp",)), get_mesh((2, 2), ("dp", "sp"))
    with pytest.raises(ShardkitError, match="no dim whose group"):
        _bad_call(flat, mesh["sp"], [Shard(2)])
