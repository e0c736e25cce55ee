"""apply_spatial: a plain conv autoencoder sharded from the outside matches the unsharded model.

Parity (float64, rtol 1e-9) of output, input gradient and every parameter gradient at R = 1-4
with the sharded dim not divisible by R; parameter names and state-dict keys unchanged;
unsupported layers listed in one ShardkitError.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.helpers import rank, world_group, world_size
from shardkit import ShardkitError, all_gather, apply_spatial, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.spatial import SpatialBatchNorm2d, SpatialConv2d, SpatialGroupNorm, SpatialUpsample

TOL = dict(rtol=1e-9, atol=1e-12)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.GroupNorm(2, c)
        self.conv = nn.Conv2d(c, c, 3, padding=2, dilation=2)  # dilated: halos reach 2

    def forward(self, x):
        return x + self.conv(nn.functional.silu(self.norm(x)))


class ConvAE(nn.Module):
    """VAE-style: strided encoder, GroupNorm, SiLU, dilated residual block, nearest x2 decoder."""

    def __init__(self, pool=False):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.GroupNorm(4, 8),
            nn.SiLU(),
            ResBlock(8),
        )
        self.pool = (
            nn.Sequential(
                nn.BatchNorm2d(8),
                nn.MaxPool2d(3, 1, 1),
                nn.AvgPool2d(3, 1, 1, count_include_pad=False),
            )
            if pool
            else nn.Identity()
        )
        self.decoder = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.GroupNorm(4, 8),
            nn.SiLU(),
            nn.Conv2d(8, 3, 3, padding=1),
        )

    def forward(self, x):
        return self.decoder(self.pool(self.encoder(x)))


CASES = [dict(dim=3, H=6, W=11, pool=False), dict(dim=2, H=9, W=5, pool=False), dict(dim=3, H=5, W=13, pool=True)]


def _params(worlds=(1, 2, 3, 4)):
    return [
        pytest.param(
            c, marks=pytest.mark.world(R), id=f"R{R}-dim{c['dim']}-H{c['H']}W{c['W']}" + ("-pool" if c["pool"] else "")
        )
        for R in worlds
        for c in CASES
    ]


@pytest.mark.parametrize("c", _params())
def test_conv_autoencoder_parity(c):
    R, r, G = world_size(), rank(), world_group()
    torch.manual_seed(0)
    ref = ConvAE(c["pool"]).double()
    with torch.no_grad():  # non-trivial affine parameters, so their gradients are checked for real
        for name, p in ref.named_parameters():
            if "norm" in name or name.startswith(("encoder.1", "decoder.2", "pool.0")):
                p.add_(torch.randn_like(p) * 0.3)
    model = apply_spatial(copy.deepcopy(ref), G, c["dim"])
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert isinstance(model.encoder[0], SpatialConv2d) and isinstance(model.encoder[3].norm, SpatialGroupNorm)
    assert isinstance(model.decoder[0], SpatialUpsample)
    x_full = torch.randn(2, 3, c["H"], c["W"], dtype=torch.float64)
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, dtype=torch.float64)
    y_ref.backward(dy)

    d = c["dim"]
    sizes = balanced_split_sizes(x_full.shape[d], R)
    x = x_full.narrow(d, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    y = model(x)
    out_sizes = [None] * R
    dist.all_gather_object(out_sizes, y.shape[d], group=G)
    y.backward(dy.narrow(d, split_offsets(out_sizes)[r], out_sizes[r]))
    bad = []
    if not torch.allclose(all_gather(y.detach(), G, d, sizes=out_sizes), y_ref, **TOL):
        bad.append("output")
    if not torch.allclose(all_gather(x.grad, G, d, sizes=sizes), x_ref.grad, **TOL):
        bad.append("input_grad")
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        if not torch.allclose(p.grad, q.grad, **TOL):
            bad.append(f"grad {name}")
    for (name, b), (_, b2) in zip(ref.named_buffers(), model.named_buffers()):
        if not torch.allclose(b.double(), b2.double(), **TOL):
            bad.append(f"buffer {name}")
    assert not bad, f"{c} sizes={sizes} out_sizes={out_sizes}: {bad}"


@pytest.mark.world(2)
def test_apply_spatial_shares_parameters_and_converts_batchnorm():
    G = world_group()
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
    weight, running = ref[0].weight, ref[1].running_mean
    model = apply_spatial(ref, G, -1)
    assert model is ref and model[0].weight is weight and model[1].running_mean is running
    assert isinstance(model[1], SpatialBatchNorm2d)
    assert isinstance(apply_spatial(nn.Conv2d(3, 3, 1), G, -1), SpatialConv2d)  # a convertible root


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.gain


@pytest.mark.world(2)
def test_apply_spatial_lists_unsupported_layers():
    G = world_group()
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.Flatten(),
        nn.Linear(4, 2),
        nn.Upsample(size=(4, 4)),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Upsample(scale_factor=1.5),
        Scale(),
        nn.LayerNorm(3),
    )
    with pytest.raises(ShardkitError) as info:
        apply_spatial(model, G, 3)
    msg = str(info.value)
    for fragment in (
        "1 (Flatten)",
        "2 (Linear)",
        "3 (Upsample): Upsample with size=",
        "4 (MaxPool2d): ceil_mode",
        "5 (Upsample): only integer",
        "6 (Scale): has parameters",
        "7 (LayerNorm)",
        "7 layer(s)",
    ):
        assert fragment in msg, (fragment, msg)
    assert type(model[0]) is nn.Conv2d  # nothing converted when anything is unsupported


@pytest.mark.world(3)
def test_apply_spatial_runs_under_check_mode():
    from shardkit.comm import checks

    G, r = world_group(), rank()
    torch.manual_seed(0)
    model = apply_spatial(ConvAE(pool=True).double(), G, 3)
    sizes = balanced_split_sizes(10, world_size())
    x = torch.randn(1, 3, 4, sizes[r], dtype=torch.float64, requires_grad=True)
    with checks(True):
        model(x).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


class TileAE(nn.Module):
    """Strided encoder, GroupNorm, dilated residual block, transposed-conv decoder (tile-friendly)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), ResBlock(8)
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),
            nn.GroupNorm(2, 4),
            nn.SiLU(),
            nn.Conv2d(4, 4, 3, stride=2, padding=1),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(4, 3, 3, padding=1),
        )

    def forward(self, x):
        return self.decoder(self.encoder(x))


@pytest.mark.world(4)
@pytest.mark.parametrize("hs,ws", [([4, 4], [6, 5]), ([6, 2], [5, 6])], ids=["balanced", "uneven"])
def test_apply_spatial_tiles_on_a_2d_mesh(hs, ws):
    from harness.helpers import get_mesh
    from shardkit.spatial import SpatialConvTranspose2d

    mesh = get_mesh((2, 2), ("h", "w"))
    i, j = mesh["h"].get_local_rank(), mesh["w"].get_local_rank()
    torch.manual_seed(0)
    ref = TileAE().double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model = apply_spatial(copy.deepcopy(ref), mesh, (2, 3))
    assert isinstance(model.decoder[0], SpatialConvTranspose2d) and isinstance(model.encoder[1], SpatialGroupNorm)
    assert isinstance(model.decoder[4], SpatialUpsample) and model.decoder[4].dim == (2, 3)
    assert list(model.state_dict()) == list(ref.state_dict())
    x_full = torch.randn(2, 3, sum(hs), sum(ws), dtype=torch.float64)
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, dtype=torch.float64)
    y_ref.backward(dy)

    def tile(t, a, b):
        return t.narrow(2, split_offsets(a)[i], a[i]).narrow(3, split_offsets(b)[j], b[j])

    x = tile(x_full, hs, ws).clone().requires_grad_()
    y = model(x)
    ohs, ows = [None] * 2, [None] * 2
    dist.all_gather_object(ohs, y.shape[2], group=mesh["h"].get_group())
    dist.all_gather_object(ows, y.shape[3], group=mesh["w"].get_group())
    y.backward(tile(dy, ohs, ows))

    def gather2(t, a, b):
        return all_gather(all_gather(t, mesh["w"], 3, sizes=b), mesh["h"], 2, sizes=a)

    bad = [] if torch.allclose(gather2(y.detach(), ohs, ows), y_ref, **TOL) else ["output"]
    if not torch.allclose(gather2(x.grad, hs, ws), x_ref.grad, **TOL):
        bad.append("input_grad")
    bad += [
        f"grad {name}"
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters())
        if not torch.allclose(p.grad, q.grad, **TOL)
    ]
    assert not bad, f"hs={hs} ws={ws} out={ohs}x{ows}: {bad}"
    with pytest.raises(ShardkitError, match="Upsample.*'bilinear' is not supported over tiles"):
        apply_spatial(nn.Sequential(nn.Conv2d(3, 3, 3), nn.Upsample(scale_factor=2, mode="bilinear")), mesh, (2, 3))


@pytest.mark.world(2)
def test_apply_spatial_learns_sizes_once_per_layout():
    from shardkit.comm import CommLedger, checks
    from shardkit.spatial._meta import layout_key

    G, r = world_group(), rank()
    torch.manual_seed(0)
    model = apply_spatial(ConvAE(pool=True).double(), G, 3)

    def gathers(width: int, key: bool = True) -> int:
        x = torch.randn(1, 3, 4, balanced_split_sizes(width, world_size())[r], dtype=torch.float64)
        with CommLedger() as ledger, torch.no_grad():
            if key:
                with layout_key((1, 3, 4, width)):
                    model(x)
            else:
                model(x)
        return ledger.count(op="metadata_all_gather")

    first = gathers(10, key=False)
    assert first > 0 and gathers(10, key=False) == first  # no key: every call learns its sizes
    assert gathers(10) == first  # the first call of a layout learns them ...
    assert gathers(10) == 0  # ... the next ones know them (default mode)
    # W = 12: the stride-2 layer's rank 0 gets 3 columns as with W = 10, its peer does not: the
    # key (not the local shape) decides, so every rank learns again
    assert gathers(12) == first
    assert gathers(10) == 0
    with checks(True):
        assert gathers(10) >= first  # the check mode learns (and agrees) on every call

    # bad input: the same error on every rank, on the first call of the layout and every later one
    short = apply_spatial(nn.Sequential(nn.Conv2d(3, 3, 5)).double(), G, 3)
    for _ in range(2):
        with layout_key("short"), pytest.raises(ShardkitError):
            short(torch.randn(1, 3, 8, 1, dtype=torch.float64))
