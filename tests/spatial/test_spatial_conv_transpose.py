"""Sharded transposed convolutions: parity with ``torch.nn.ConvTranspose*d`` and apply_spatial.

Parity: output, input gradient, weight and bias gradients against the unsharded torch layer
(float64, rtol 1e-9), gathered with :func:`shardkit.all_gather`, over a sampled grid (kernel
1-4, stride 1-3, padding 0-2, output padding, dilation 1-2, groups, 1-d / 2-d / 3-d, channels
first / last, uneven and zero-size splits) plus hand-picked cases, at R = 1-4.
"""

import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.helpers import rank, world_group, world_size
from harness.tiers import edge_and_sample
from shardkit import ShardkitError, ShardkitTypeError, all_gather, apply_spatial, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.spatial import (
    SpatialConvTranspose2d,
    spatial_conv_transpose1d,
    spatial_conv_transpose2d,
    spatial_conv_transpose3d,
    spatial_transpose_output_sizes,
)

FNS = {1: spatial_conv_transpose1d, 2: spatial_conv_transpose2d, 3: spatial_conv_transpose3d}
MODULES = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
TOL = dict(rtol=1e-9, atol=1e-12)


def _split(kind, n, R):
    if kind == "balanced" or R == 1:
        return balanced_split_sizes(n, R)
    if kind == "zero_first":
        return [0] + balanced_split_sizes(n, R - 1)
    sizes = [0] * R  # lopsided, zero-size shards in the middle
    sizes[0], sizes[-1] = n // 2, n - n // 2
    return sizes


def _case(nd, shard, k, s, p, q, d, groups, split, n, cl=False):
    return dict(nd=nd, shard=shard, k=k, s=s, p=p, q=q, d=d, groups=groups, split=split, n=n, cl=cl)


def _valid(c):
    return c["q"] < max(c["s"], c["d"]) and (c["n"] - 1) * c["s"] - 2 * c["p"] + c["d"] * (c["k"] - 1) + c["q"] + 1 >= 1


def _sampled(R, count):
    rng = random.Random(2000 + R)
    cases = []
    while len(cases) < count:
        nd = rng.choice([1, 2, 2, 3])
        s, d = rng.randint(1, 3), rng.randint(1, 2)
        c = _case(
            nd,
            rng.randrange(nd),
            rng.randint(1, 4),
            s,
            rng.randint(0, 2),
            rng.randint(0, max(s, d) - 1),
            d,
            rng.choice([1, 2]),
            rng.choice(["balanced", "zero_first", "ragged"]),
            rng.randint(R, 9),
            cl=rng.random() < 0.25,
        )
        if _valid(c):
            cases.append(c)
    return cases


EDGE = [
    _case(2, 1, 4, 2, 1, 0, 1, 1, "balanced", 8),  # the usual x2 upsampling: even split -> 2 * sizes
    _case(2, 1, 2, 2, 0, 0, 1, 1, "balanced", 8),  # patch-unfold: no traffic at even splits
    _case(2, 0, 3, 2, 1, 1, 1, 1, "ragged", 7),  # output_padding, H sharded
    _case(1, 0, 1, 3, 0, 2, 1, 1, "balanced", 5),  # stride > kernel: gaps of bias-only outputs
    _case(1, 0, 3, 1, 2, 0, 2, 2, "zero_first", 6),  # dilated, padding shrinks the output
    _case(3, 2, 4, 3, 2, 1, 1, 1, "balanced", 5, cl=True),
]
assert all(_valid(c) for c in EDGE)


def _ids(cases):
    return [
        f"{c['nd']}d-s{c['shard']}-k{c['k']}s{c['s']}p{c['p']}q{c['q']}d{c['d']}-g{c['groups']}-{c['split']}{c['n']}"
        + ("-cl" if c["cl"] else "")
        for c in cases
    ]


def _parity(c, seed=0):
    R, r, G = world_size(), rank(), world_group()
    nd, j = c["nd"], c["shard"]
    gen = torch.Generator().manual_seed(seed)
    c_in = 2 * c["groups"]
    spatial = [4, 3, 3][:nd]
    spatial[j] = c["n"]
    kernel, stride, pad, opad, dil = ([v] * nd for v in (2, 1, 1, 0, 1))
    kernel[j], stride[j], pad[j], opad[j], dil[j] = c["k"], c["s"], c["p"], c["q"], c["d"]
    if nd > 1:  # the other dims: a strided transposed conv with output padding too
        o = (j + 1) % nd
        kernel[o], stride[o], pad[o], opad[o] = 3, 2, 1, 1
    ref = MODULES[nd](
        c_in,
        4,
        kernel,
        stride=stride,
        padding=pad,
        output_padding=opad,
        groups=c["groups"],
        dilation=dil,
        dtype=torch.float64,
    )
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=gen, dtype=torch.float64))
        ref.bias.copy_(torch.randn(ref.bias.shape, generator=gen, dtype=torch.float64))
    x_full = torch.randn([2, c_in, *spatial], generator=gen, dtype=torch.float64)
    dim = 2 + j
    if c["cl"]:
        x_full, dim = x_full.movedim(1, -1).contiguous(), 1 + j
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref.movedim(-1, 1)).movedim(1, -1) if c["cl"] else ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    y_ref.backward(dy)

    sizes = _split(c["split"], c["n"], R)
    out_sizes = spatial_transpose_output_sizes(sizes, c["k"], c["s"], c["p"], c["q"], c["d"])
    x = x_full.narrow(dim, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    w = ref.weight.detach().clone().requires_grad_()
    b = ref.bias.detach().clone().requires_grad_()
    y = FNS[nd](
        x,
        w,
        b,
        G,
        dim,
        tuple(stride),
        tuple(pad),
        tuple(opad),
        c["groups"],
        tuple(dil),
        sizes=sizes,
        channels_last=c["cl"],
    )
    y.backward(dy.narrow(dim, split_offsets(out_sizes)[r], out_sizes[r]))
    y_full = all_gather(y.detach(), G, dim, sizes=out_sizes)
    gx_full = all_gather(x.grad, G, dim, sizes=sizes)
    checks = {
        "local_output_size": y.shape[dim] == out_sizes[r],
        "output": torch.allclose(y_full, y_ref, **TOL),
        "input_grad": torch.allclose(gx_full, x_ref.grad, **TOL),
        "weight_grad": torch.allclose(w.grad, ref.weight.grad, **TOL),
        "bias_grad": torch.allclose(b.grad, ref.bias.grad, **TOL),
    }
    bad = [name for name, ok in checks.items() if not ok]
    assert not bad, f"{c} sizes={sizes} out_sizes={out_sizes}: mismatched {bad}"


@pytest.mark.world(1)
@pytest.mark.parametrize("c", EDGE, ids=_ids(EDGE))
def test_parity_r1(c):
    _parity(c)


@pytest.mark.world(2)
@pytest.mark.parametrize("c", edge_and_sample(EDGE, _sampled(2, 24), _ids(EDGE + _sampled(2, 24))))
def test_parity_r2(c):
    _parity(c)


@pytest.mark.world(3)
@pytest.mark.parametrize("c", edge_and_sample(EDGE, _sampled(3, 24), _ids(EDGE + _sampled(3, 24))))
def test_parity_r3(c):
    _parity(c)


@pytest.mark.world(4)
@pytest.mark.parametrize("c", edge_and_sample(EDGE, _sampled(4, 24), _ids(EDGE + _sampled(4, 24))))
def test_parity_r4(c):
    _parity(c)


def test_output_sizes_rule():
    # x2 upsampling layers map an even split to 2 * sizes; k = 2p + 1 at stride 1 keeps the split
    assert spatial_transpose_output_sizes([4, 4], 4, 2, 1) == [8, 8]
    assert spatial_transpose_output_sizes([3, 3, 3], 2, 2, 0) == [6, 6, 6]
    assert spatial_transpose_output_sizes([3, 2, 2], 3, 2, 1, 1) == [6, 4, 4]
    for sizes in ([4, 3, 3], [0, 5, 0, 2], [7]):
        assert spatial_transpose_output_sizes(sizes, 3, 1, 1) == sizes
    with pytest.raises(ShardkitError, match="output_padding"):
        spatial_transpose_output_sizes([2, 2], 3, 2, 0, output_padding=2)
    with pytest.raises(ShardkitError, match="output length"):
        spatial_transpose_output_sizes([1, 0], 1, 1, 1)


@pytest.mark.world(2)
def test_ledger_conv_transpose_forward_backward_exact():
    # x2 upsampling (k=4, s=2, p=1) of W = 2 * 4: each rank needs one neighbour column
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with CommLedger() as ledger:
        y = spatial_conv_transpose2d(x, w, b, world_group(), -1, 2, 1)
        y.sum().backward()
    assert y.shape[-1] == 8
    api = "spatial_conv_transpose2d"
    assert ledger.count(op="all_to_all_single", api=api, phase="forward") == 1
    assert ledger.count(op="all_to_all_single", api=api, phase="backward") == 1
    assert ledger.count(op="all_reduce", api=api, phase="backward") == 1  # weight + bias fused
    assert ledger.count(op="metadata_all_gather", phase="metadata") == 1  # no sizes=: learned
    assert ledger.count() == 4
    column = 2 * 3 * 5 * 8  # one W column of [B=2, C=3, H=5] float64
    assert ledger.bytes_received(op="all_to_all_single", phase="forward") == column
    assert ledger.bytes_sent(op="all_reduce") == (3 * 4 * 3 * 4 + 4) * 8


@pytest.mark.world(2)
def test_errors_and_from_module():
    G = world_group()
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(ShardkitError, match="output_padding"):
        spatial_conv_transpose2d(x, torch.randn(2, 2, 3, 3), None, G, -1, 1, 0, 1)
    with pytest.raises(ShardkitError, match="not a spatial dim"):
        spatial_conv_transpose2d(x, torch.randn(2, 2, 3, 3), None, G, 1)
    with pytest.raises(ShardkitError, match="weight must be"):
        spatial_conv_transpose2d(x, torch.randn(3, 2, 3, 3), None, G, -1)
    with pytest.raises(ShardkitTypeError, match="expected an ConvTranspose2d"):
        SpatialConvTranspose2d.from_module(nn.Conv2d(2, 2, 3), G, -1)
    conv = nn.ConvTranspose2d(2, 3, 4, 2, 1)
    layer = SpatialConvTranspose2d.from_module(conv, G, -1)
    assert layer.weight is conv.weight and layer.bias is conv.bias
    assert layer(x).shape == (1, 3, 6, 8)


class Decoder(nn.Module):
    """x2 transposed-conv upsampling decoder with a 1-d-sharded frame."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.SiLU(),
            nn.ConvTranspose2d(4, 4, 4, 2, 1),
            nn.GroupNorm(2, 4),
            nn.ConvTranspose2d(4, 2, 3, 2, 1, output_padding=1),
        )

    def forward(self, x):
        return self.net(x)


@pytest.mark.world(3)
def test_apply_spatial_converts_conv_transpose():
    R, r, G = world_size(), rank(), world_group()
    torch.manual_seed(0)
    ref = Decoder().double()
    model = apply_spatial(copy.deepcopy(ref), G, 3)
    assert isinstance(model.net[2], SpatialConvTranspose2d) and list(model.state_dict()) == list(ref.state_dict())
    x_full = torch.randn(2, 3, 4, 7, dtype=torch.float64)
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, dtype=torch.float64)
    y_ref.backward(dy)
    sizes = balanced_split_sizes(7, R)
    x = x_full.narrow(3, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    y = model(x)
    out_sizes = [None] * R
    dist.all_gather_object(out_sizes, y.shape[3], group=G)
    y.backward(dy.narrow(3, split_offsets(out_sizes)[r], out_sizes[r]))
    assert torch.allclose(all_gather(y.detach(), G, 3, sizes=out_sizes), y_ref, **TOL)
    assert torch.allclose(all_gather(x.grad, G, 3, sizes=sizes), x_ref.grad, **TOL)
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.allclose(p.grad, q.grad, **TOL), name
