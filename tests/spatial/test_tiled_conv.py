"""Convolutions over H x W tiles on a 2x2 mesh: parity with the unsharded torch convolution.

Halos are exchanged along H over the mesh's "h" dim, then along W over "w" (corners carried by
the second exchange). Output, input gradient, weight and bias gradients vs ``nn.Conv2d``
(float64, rtol 1e-9), with uneven and zero-size tiles and every padding mode.
"""

import pytest
import torch
from torch import nn

from harness.helpers import get_mesh, world_size
from shardkit import all_gather, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.spatial import SpatialConv2d, spatial_conv2d, spatial_output_sizes

TOL = dict(rtol=1e-9, atol=1e-12)

CASES = [
    dict(H=7, W=5, k=3, s=1, p=1, d=1, mode="zeros", hs=None, ws=None),
    dict(H=8, W=9, k=3, s=2, p=1, d=1, mode="zeros", hs=None, ws=None),
    dict(H=6, W=7, k=3, s=1, p=2, d=2, mode="zeros", hs=[1, 5], ws=None),
    dict(H=5, W=6, k=3, s=1, p=1, d=1, mode="reflect", hs=None, ws=[4, 2]),
    dict(H=5, W=6, k=5, s=1, p=2, d=1, mode="replicate", hs=[0, 5], ws=None),
    dict(H=6, W=5, k=3, s=1, p=1, d=1, mode="circular", hs=None, ws=[0, 5]),
    dict(H=7, W=7, k=4, s=3, p=0, d=1, mode="zeros", hs=None, ws=None),
]


def _tile(full, mesh, hs, ws, dh=2, dw=3):
    i, j = mesh["h"].get_local_rank(), mesh["w"].get_local_rank()
    return full.narrow(dh, split_offsets(hs)[i], hs[i]).narrow(dw, split_offsets(ws)[j], ws[j])


def _gather2(y, mesh, hs, ws, dh=2, dw=3):
    return all_gather(all_gather(y, mesh["w"], dw, sizes=ws), mesh["h"], dh, sizes=hs)


@pytest.mark.world(4)
@pytest.mark.parametrize(
    "c", CASES, ids=[f"{c['mode']}-k{c['k']}s{c['s']}p{c['p']}d{c['d']}-{c['H']}x{c['W']}" for c in CASES]
)
def test_tiled_conv2d_parity(c):
    assert world_size() == 4
    mesh = get_mesh((2, 2), ("h", "w"))
    gen = torch.Generator().manual_seed(0)
    ref = nn.Conv2d(3, 4, c["k"], c["s"], c["p"], c["d"], padding_mode=c["mode"], dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=gen, dtype=torch.float64))
        ref.bias.copy_(torch.randn(ref.bias.shape, generator=gen, dtype=torch.float64))
    x_full = torch.randn(2, 3, c["H"], c["W"], generator=gen, dtype=torch.float64, requires_grad=True)
    y_ref = ref(x_full)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    y_ref.backward(dy)
    hs, ws = c["hs"] or balanced_split_sizes(c["H"], 2), c["ws"] or balanced_split_sizes(c["W"], 2)
    ohs, ows = (spatial_output_sizes(sz, c["k"], c["s"], c["p"], c["d"]) for sz in (hs, ws))
    x = _tile(x_full.detach(), mesh, hs, ws).clone().requires_grad_()
    w, b = ref.weight.detach().clone().requires_grad_(), ref.bias.detach().clone().requires_grad_()
    y = spatial_conv2d(
        x, w, b, (mesh["h"], mesh["w"]), (2, 3), c["s"], c["p"], c["d"], padding_mode=c["mode"], sizes=(hs, ws)
    )
    y.backward(_tile(dy, mesh, ohs, ows))
    bad = [
        name
        for name, ok in {
            "output": torch.allclose(_gather2(y.detach(), mesh, ohs, ows), y_ref, **TOL),
            "input_grad": torch.allclose(_gather2(x.grad, mesh, hs, ws), x_full.grad, **TOL),
            "weight_grad": torch.allclose(w.grad, ref.weight.grad, **TOL),
            "bias_grad": torch.allclose(b.grad, ref.bias.grad, **TOL),
        }.items()
        if not ok
    ]
    assert not bad, f"{c} hs={hs} ws={ws}: {bad}"


@pytest.mark.world(4)
def test_tiled_layer_channels_last_and_ledger():
    mesh = get_mesh((2, 2), ("h", "w"))
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
    layer = SpatialConv2d.from_conv(conv, (mesh["h"], mesh["w"]), (1, 2), channels_last=True)
    full = torch.randn(2, 6, 5, 3, dtype=torch.float64)  # NHWC
    hs, ws = [3, 3], [3, 2]
    x = _tile(full, mesh, hs, ws, 1, 2).clone().requires_grad_()
    with CommLedger() as ledger:
        y = layer(x, sizes=(hs, ws))
        y.sum().backward()
    ref = conv(full.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    assert torch.allclose(_gather2(y.detach(), mesh, hs, ws, 1, 2), ref, **TOL)
    assert ledger.count(op="all_to_all_single", phase="forward") == 2  # along H, then along W
    assert ledger.count(op="all_to_all_single", phase="backward") == 2
    assert ledger.count(op="all_reduce", phase="backward") == 2  # parameter gradients: over "w", then "h"
    assert "dim=(1, 2)" in repr(layer)


CASES_3D = [
    dict(D=4, H=7, W=5, k=3, s=1, p=1, dims=(3, 4), hs=None, ws=[0, 5]),
    dict(D=5, H=6, W=6, k=3, s=2, p=1, dims=(2, 4), hs=[4, 1], ws=None),
]


@pytest.mark.world(4)
@pytest.mark.parametrize("c", CASES_3D, ids=["HxW-zero-tile", "DxW-strided"])
def test_tiled_conv3d_parity(c):
    """Conv3d over two sharded dims (H x W, or D x W) of a 2x2 mesh."""
    from shardkit.spatial import spatial_conv3d

    mesh = get_mesh((2, 2), ("h", "w"))
    gen = torch.Generator().manual_seed(1)
    ref = nn.Conv3d(2, 3, c["k"], c["s"], c["p"], dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=gen, dtype=torch.float64))
        ref.bias.copy_(torch.randn(ref.bias.shape, generator=gen, dtype=torch.float64))
    x_full = torch.randn(1, 2, c["D"], c["H"], c["W"], generator=gen, dtype=torch.float64, requires_grad=True)
    y_ref = ref(x_full)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    y_ref.backward(dy)
    d0, d1 = c["dims"]
    n0, n1 = x_full.shape[d0], x_full.shape[d1]
    s0, s1 = c["hs"] or balanced_split_sizes(n0, 2), c["ws"] or balanced_split_sizes(n1, 2)
    o0, o1 = (spatial_output_sizes(sz, c["k"], c["s"], c["p"]) for sz in (s0, s1))
    x = _tile(x_full.detach(), mesh, s0, s1, d0, d1).clone().requires_grad_()
    w, b = ref.weight.detach().clone().requires_grad_(), ref.bias.detach().clone().requires_grad_()
    y = spatial_conv3d(x, w, b, (mesh["h"], mesh["w"]), (d0, d1), c["s"], c["p"], sizes=(s0, s1))
    y.backward(_tile(dy, mesh, o0, o1, d0, d1))
    bad = [
        name
        for name, ok in {
            "output": torch.allclose(_gather2(y.detach(), mesh, o0, o1, d0, d1), y_ref, **TOL),
            "input_grad": torch.allclose(_gather2(x.grad, mesh, s0, s1, d0, d1), x_full.grad, **TOL),
            "weight_grad": torch.allclose(w.grad, ref.weight.grad, **TOL),
            "bias_grad": torch.allclose(b.grad, ref.bias.grad, **TOL),
        }.items()
        if not ok
    ]
    assert not bad, f"{c}: {bad}"


# ---------------------------------------------------------------- transposed convolutions over tiles

CASES_T = [
    dict(H=4, W=5, k=4, s=2, p=1, q=0, d=1, hs=None, ws=None),  # x2 upsampling
    dict(H=5, W=4, k=3, s=2, p=1, q=1, d=1, hs=[4, 1], ws=None),  # output_padding, uneven H
    dict(H=5, W=6, k=3, s=1, p=1, q=0, d=2, hs=None, ws=[0, 6]),  # dilated, an empty W tile
    dict(H=4, W=4, k=2, s=2, p=0, q=0, d=1, hs=None, ws=None),  # unpatchify: no halo at all
]


@pytest.mark.world(4)
@pytest.mark.parametrize("c", CASES_T, ids=["up2", "opad-uneven", "dilated-zero-tile", "unpatchify"])
def test_tiled_conv_transpose2d_parity(c):
    from shardkit.spatial import spatial_conv_transpose2d, spatial_transpose_output_sizes

    mesh = get_mesh((2, 2), ("h", "w"))
    gen = torch.Generator().manual_seed(2)
    ref = nn.ConvTranspose2d(3, 4, c["k"], c["s"], c["p"], c["q"], dilation=c["d"], dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=gen, dtype=torch.float64))
        ref.bias.copy_(torch.randn(ref.bias.shape, generator=gen, dtype=torch.float64))
    x_full = torch.randn(2, 3, c["H"], c["W"], generator=gen, dtype=torch.float64, requires_grad=True)
    y_ref = ref(x_full)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    y_ref.backward(dy)
    hs, ws = c["hs"] or balanced_split_sizes(c["H"], 2), c["ws"] or balanced_split_sizes(c["W"], 2)
    ohs, ows = (spatial_transpose_output_sizes(sz, c["k"], c["s"], c["p"], c["q"], c["d"]) for sz in (hs, ws))
    x = _tile(x_full.detach(), mesh, hs, ws).clone().requires_grad_()
    w, b = ref.weight.detach().clone().requires_grad_(), ref.bias.detach().clone().requires_grad_()
    y = spatial_conv_transpose2d(
        x, w, b, (mesh["h"], mesh["w"]), (2, 3), c["s"], c["p"], c["q"], 1, c["d"], sizes=(hs, ws)
    )
    y.backward(_tile(dy, mesh, ohs, ows))
    bad = [
        name
        for name, ok in {
            "local_shape": tuple(y.shape[2:]) == (ohs[mesh["h"].get_local_rank()], ows[mesh["w"].get_local_rank()]),
            "output": torch.allclose(_gather2(y.detach(), mesh, ohs, ows), y_ref, **TOL),
            "input_grad": torch.allclose(_gather2(x.grad, mesh, hs, ws), x_full.grad, **TOL),
            "weight_grad": torch.allclose(w.grad, ref.weight.grad, **TOL),
            "bias_grad": torch.allclose(b.grad, ref.bias.grad, **TOL),
        }.items()
        if not ok
    ]
    assert not bad, f"{c} hs={hs} ws={ws}: {bad}"


@pytest.mark.world(4)
def test_tiled_conv_transpose_layer_infers_sizes_and_ledger():
    from shardkit.spatial import SpatialConvTranspose2d

    mesh = get_mesh((2, 2), ("h", "w"))
    torch.manual_seed(0)
    conv = nn.ConvTranspose2d(3, 2, 4, 2, 1, dtype=torch.float64)
    layer = SpatialConvTranspose2d.from_module(conv, (mesh["h"], mesh["w"]), (2, 3))
    layer.infer_sizes = True  # as apply_spatial sets it: the uneven tile sizes are all-gathered
    full = torch.randn(1, 3, 5, 3, dtype=torch.float64)
    hs, ws = [3, 2], [1, 2]
    x = _tile(full, mesh, hs, ws).clone().requires_grad_()
    with CommLedger() as ledger:
        y = layer(x)
        y.sum().backward()
    assert torch.allclose(_gather2(y.detach(), mesh, [6, 4], [2, 4]), conv(full), **TOL)
    assert ledger.count(op="all_to_all_single", phase="forward") == 2  # along H, then along W
    assert ledger.count(op="all_to_all_single", phase="backward") == 2
    assert ledger.count(op="all_reduce", phase="backward") == 2  # parameter gradients: over "w", then "h"
    assert ledger.count(op="metadata_all_gather") == 2
