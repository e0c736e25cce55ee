"""Sharded GroupNorm, BatchNorm2d, upsampling and pooling: parity with torch on the full frame.

Parity: output, input gradient and every parameter gradient against the torch layer on the
unsharded tensor (float64, rtol 1e-9), over even, uneven and zero-size splits of H or W at
R = 1-4; ledger counts for GroupNorm; unsupported settings raise ShardkitError.
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import rank, world_group, world_size
from shardkit import ShardkitError, all_gather, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.spatial import (
    SpatialAvgPool2d,
    SpatialBatchNorm2d,
    SpatialGroupNorm,
    SpatialMaxPool2d,
    SpatialUpsample,
    spatial_avg_pool,
    spatial_group_norm,
    spatial_interpolate,
    spatial_max_pool,
    spatial_output_sizes,
)

TOL = dict(rtol=1e-9, atol=1e-12)
SPLITS = {
    "balanced": lambda n, R: balanced_split_sizes(n, R),
    "zero_first": lambda n, R: [0] + balanced_split_sizes(n, R - 1) if R > 1 else [n],
    "lopsided": lambda n, R: [n - (R - 1)] + [1] * (R - 1),
}


def _worlds(cases, worlds=(1, 2, 3, 4)):
    """Each case at each world size, as pytest params marked with their world."""
    return [
        pytest.param(c, marks=pytest.mark.world(R), id=f"R{R}-" + "-".join(f"{k}{v}" for k, v in c.items()))
        for R in worlds
        for c in cases
    ]


def _gather_check(ref, layer, x_full, dim, split, out_sizes_of, layer_kwargs=None, seed=0):
    """Forward/backward of ``ref`` on the full tensor and ``layer`` on this rank's block; list of mismatches."""
    R, r, G = world_size(), rank(), world_group()
    gen = torch.Generator().manual_seed(seed + 1)
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    y_ref.backward(dy)
    sizes = SPLITS[split](x_full.shape[dim], R)
    out_sizes = out_sizes_of(sizes)
    x = x_full.narrow(dim, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    y = layer(x, **(layer_kwargs(sizes) if layer_kwargs else {}))
    y.backward(dy.narrow(dim, split_offsets(out_sizes)[r], out_sizes[r]))
    bad = []
    if y.shape[dim] != out_sizes[r]:
        bad.append(f"local size {y.shape[dim]} != {out_sizes[r]}")
    if not torch.allclose(all_gather(y.detach(), G, dim, sizes=out_sizes), y_ref, **TOL):
        bad.append("output")
    if not torch.allclose(all_gather(x.grad, G, dim, sizes=sizes), x_ref.grad, **TOL):
        bad.append("input_grad")
    for (name, p), q in zip(ref.named_parameters(), layer.parameters()):
        if not torch.allclose(p.grad, q.grad, **TOL):
            bad.append(f"grad {name}")
    return bad, sizes


def _randomize(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


# ---------------------------------------------------------------- GroupNorm


GN_CASES = [
    dict(shape=(2, 6, 5, 7), groups=3, dim=3, split="balanced"),
    dict(shape=(2, 6, 7, 4), groups=2, dim=2, split="zero_first"),
    dict(shape=(1, 4, 3, 4, 6), groups=4, dim=4, split="lopsided"),
    dict(shape=(2, 6, 9), groups=1, dim=2, split="balanced"),
]


@pytest.mark.parametrize("c", _worlds(GN_CASES))
def test_group_norm_parity(c):
    gen = torch.Generator().manual_seed(0)
    ref = _randomize(nn.GroupNorm(c["groups"], c["shape"][1], dtype=torch.float64), gen)
    layer = SpatialGroupNorm.from_module(copy.deepcopy(ref), world_group())
    x_full = torch.randn(c["shape"], generator=gen, dtype=torch.float64) * 3 + 100  # offset: tests stability
    bad, sizes = _gather_check(ref, layer, x_full, c["dim"], c["split"], lambda s: s)
    assert not bad, f"{c} sizes={sizes}: {bad}"


@pytest.mark.world(3)
def test_group_norm_ledger_and_state_dict():
    G, R = world_group(), world_size()
    gn = nn.GroupNorm(2, 4, dtype=torch.float64)
    layer = SpatialGroupNorm.from_module(gn, G)
    assert layer.weight is gn.weight and set(layer.state_dict()) == set(gn.state_dict())
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    with CommLedger() as ledger:
        layer(x).square().sum().backward()
    assert ledger.count(op="all_gather_single", phase="forward") == 1
    assert ledger.bytes_received(op="all_gather_single") == R * 3 * (2 * 2) * 8  # (count, mean, M2) per (B, group)
    assert ledger.count(phase="backward", op="reduce_scatter_single") == 1
    assert ledger.count(op="all_reduce", api="spatial_group_norm", phase="backward") == 1  # weight + bias fused
    assert ledger.count() == 3
    with CommLedger() as ledger, torch.no_grad():
        spatial_group_norm(x, 2, None, None, G)
    assert ledger.count() == 1  # no affine, no autograd: the statistics gather only


@pytest.mark.world(2)
def test_group_norm_bfloat16_rounds_once():
    # Half precision is computed in float32 and rounded once, as torch's group_norm forward:
    # every result is within one bfloat16 ulp of the float64 computation on the same inputs.
    # (Statistics and normalization in bfloat16 drift by many roundings, which training
    # accumulates: `shardkit train --model conv-ae --dtype bfloat16 --verify` failed on it.)
    r, G = rank(), world_group()
    gen = torch.Generator().manual_seed(3)
    x_full = (torch.randn(2, 8, 6, 10, generator=gen) * 2 + 5).bfloat16()
    w = torch.randn(8, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(8, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(2, 8, 6, 10, generator=gen).bfloat16()
    x_ref = x_full.double().requires_grad_()
    w_ref, b_ref = (t.detach().double().requires_grad_() for t in (w, b))
    y_ref = nn.functional.group_norm(x_ref, 4, w_ref, b_ref)
    y_ref.backward(dy.double())
    sizes = [4, 6]
    x = x_full.narrow(3, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    y = spatial_group_norm(x, 4, w, b, G)
    y.backward(dy.narrow(3, split_offsets(sizes)[r], sizes[r]))
    y_full = all_gather(y.detach(), G, 3, sizes=sizes)
    gx_full = all_gather(x.grad, G, 3, sizes=sizes)
    ulp = 2.0**-7  # bfloat16: 8 significant bits
    for name, got, want in (
        ("output", y_full, y_ref),
        ("input_grad", gx_full, x_ref.grad),
        ("weight_grad", w.grad, w_ref.grad),
        ("bias_grad", b.grad, b_ref.grad),
    ):
        err = ((got.double() - want).abs() / want.abs().clamp(min=1e-2)).max().item()
        assert got.dtype == torch.bfloat16 and err <= ulp, f"{name}: {err:.2e} relative (> one bfloat16 ulp {ulp})"


# ---------------------------------------------------------------- BatchNorm2d


BN_CASES = [dict(momentum=0.1, split="balanced", dim=3), dict(momentum=None, split="zero_first", dim=2)]


@pytest.mark.parametrize("c", _worlds(BN_CASES, (2, 3, 4)))
def test_batch_norm_parity_and_running_stats(c):
    gen = torch.Generator().manual_seed(0)
    ref = _randomize(nn.BatchNorm2d(3, momentum=c["momentum"], dtype=torch.float64), gen)
    layer = SpatialBatchNorm2d.from_module(copy.deepcopy(ref), world_group())
    for step in range(2):  # running statistics over two steps (momentum None: cumulative average)
        x_full = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64) + step
        for m in (ref, layer):
            for p in m.parameters():
                p.grad = None
        bad, sizes = _gather_check(ref, layer, x_full, c["dim"], c["split"], lambda s: s)
        assert not bad, f"{c} step {step} sizes={sizes}: {bad}"
    for name, buf in ref.named_buffers():
        assert torch.allclose(buf.double(), getattr(layer, name).double(), **TOL), name
    ref.eval(), layer.eval()
    x_full = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64)
    bad, _ = _gather_check(ref, layer, x_full, c["dim"], c["split"], lambda s: s)
    assert not bad, f"eval: {bad}"


# ---------------------------------------------------------------- upsampling


UP_CASES = [
    dict(shape=(2, 3, 5, 7), scale=2, mode="nearest", dim=3, split="balanced"),
    dict(shape=(2, 3, 5, 4), scale=3, mode="nearest-exact", dim=2, split="zero_first"),
    dict(shape=(2, 3, 5, 7), scale=2, mode="bilinear", dim=3, split="balanced"),
    dict(shape=(1, 2, 7, 4), scale=3, mode="bilinear", dim=2, split="zero_first"),
    dict(shape=(1, 2, 6, 5), scale=(2, 3), mode="bilinear", dim=3, split="lopsided"),
    dict(shape=(2, 3, 9), scale=4, mode="linear", dim=2, split="lopsided"),
    dict(shape=(1, 2, 3, 6, 4), scale=2, mode="trilinear", dim=3, split="balanced"),
]


@pytest.mark.parametrize("c", _worlds(UP_CASES))
def test_upsample_parity(c):
    gen = torch.Generator().manual_seed(0)
    ref = nn.Upsample(scale_factor=c["scale"], mode=c["mode"])
    layer = SpatialUpsample.from_module(ref, world_group(), c["dim"])
    s = c["scale"] if isinstance(c["scale"], int) else c["scale"][c["dim"] - 2]
    x_full = torch.randn(c["shape"], generator=gen, dtype=torch.float64)
    bad, sizes = _gather_check(
        ref, layer, x_full, c["dim"], c["split"], lambda sz: [n * s for n in sz], lambda sz: dict(sizes=sz)
    )
    assert not bad, f"{c} sizes={sizes}: {bad}"


@pytest.mark.world(2)
def test_upsample_channels_last_and_traffic():
    G, r = world_group(), rank()
    full = torch.randn(1, 6, 8, 3, dtype=torch.float64)  # NHWC, sharded along W (dim 2)
    local = full[:, :, 4 * r : 4 * r + 4]
    ref = torch.nn.functional.interpolate(full.permute(0, 3, 1, 2), scale_factor=2, mode="bilinear").permute(0, 2, 3, 1)
    with CommLedger() as ledger:
        y = spatial_interpolate(local, G, 2, 2, "bilinear", channels_last=True)
        n = spatial_interpolate(local, G, 2, 2, "nearest", channels_last=True)
    assert torch.allclose(all_gather(y, G, 2), ref, **TOL)
    assert torch.equal(all_gather(n, G, 2), full.repeat_interleave(2, 1).repeat_interleave(2, 2))
    # bilinear: one halo exchange after learning the split (no sizes=); nearest: none
    assert ledger.count(phase="metadata") == 1 and ledger.count() == 2


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(scale_factor=1.5), "integer"),
        (dict(scale_factor=2, mode="bicubic"), "not supported"),
        (dict(scale_factor=2, mode="bilinear", align_corners=True), "align_corners"),
        (dict(scale_factor=2, mode="trilinear"), "3 spatial"),
    ],
)
@pytest.mark.world(2)
def test_upsample_unsupported_raise(kwargs, fragment):
    x = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ShardkitError, match=fragment):
        spatial_interpolate(x, world_group(), 3, **kwargs)


# ---------------------------------------------------------------- pooling


POOL_CASES = [
    dict(kind="max", k=3, s=2, p=1, d=1, dim=3, split="balanced", n=9),
    dict(kind="max", k=2, s=2, p=0, d=1, dim=2, split="zero_first", n=8),
    dict(kind="max", k=3, s=1, p=1, d=2, dim=3, split="lopsided", n=7),
    dict(kind="avg", k=3, s=2, p=1, d=1, dim=3, split="balanced", n=9, cip=True),
    dict(kind="avg", k=3, s=2, p=1, d=1, dim=2, split="zero_first", n=7, cip=False),
    dict(kind="avg", k=(2, 3), s=(1, 2), p=(1, 1), d=1, dim=3, split="lopsided", n=8, cip=False),
    dict(kind="avg", k=4, s=3, p=2, d=1, dim=3, split="balanced", n=10, div=5),
]


@pytest.mark.parametrize("c", _worlds(POOL_CASES))
def test_pool_parity(c):
    gen = torch.Generator().manual_seed(0)
    shape = [2, 3, 6, 6]
    shape[c["dim"]] = c["n"]
    j = c["dim"] - 2
    pick = lambda v: v[j] if isinstance(v, tuple) else v  # noqa: E731
    if c["kind"] == "max":
        ref = nn.MaxPool2d(c["k"], c["s"], c["p"], c["d"])
        layer = SpatialMaxPool2d.from_module(ref, world_group(), c["dim"])
    else:
        ref = nn.AvgPool2d(c["k"], c["s"], c["p"], count_include_pad=c.get("cip", True), divisor_override=c.get("div"))
        layer = SpatialAvgPool2d.from_module(ref, world_group(), c["dim"])
    x_full = torch.randn(shape, generator=gen, dtype=torch.float64)
    bad, sizes = _gather_check(
        ref,
        layer,
        x_full,
        c["dim"],
        c["split"],
        lambda sz: spatial_output_sizes(sz, pick(c["k"]), pick(c["s"]), pick(c["p"]), c["d"]),
        lambda sz: dict(sizes=sz),
    )
    assert not bad, f"{c} sizes={sizes}: {bad}"


@pytest.mark.world(3)
def test_pool_1d_3d_and_channels_last():
    G, R, r = world_group(), world_size(), rank()
    gen = torch.Generator().manual_seed(0)
    sizes = balanced_split_sizes(8, R)
    off = split_offsets(sizes)
    x1 = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    out = spatial_output_sizes(sizes, 3, 2, 1)
    y = spatial_avg_pool(x1[..., off[r] : off[r] + sizes[r]], G, 2, 3, 2, 1, count_include_pad=False, sizes=sizes)
    ref = nn.functional.avg_pool1d(x1, 3, 2, 1, count_include_pad=False)
    assert torch.allclose(all_gather(y, G, 2, sizes=out), ref, **TOL)
    x3 = torch.randn(1, 2, 4, 8, 3, generator=gen, dtype=torch.float64)
    y = spatial_max_pool(x3[:, :, :, off[r] : off[r] + sizes[r]], G, 3, 3, 2, 1, sizes=sizes)
    assert torch.allclose(all_gather(y, G, 3, sizes=out), nn.functional.max_pool3d(x3, 3, 2, 1), **TOL)
    x2 = torch.randn(2, 5, 8, 3, generator=gen, dtype=torch.float64)  # NHWC sharded along W
    y = spatial_max_pool(x2[:, :, off[r] : off[r] + sizes[r]], G, 2, 3, 2, 1, sizes=sizes, channels_last=True)
    ref = nn.functional.max_pool2d(x2.permute(0, 3, 1, 2), 3, 2, 1).permute(0, 2, 3, 1)
    assert torch.allclose(all_gather(y, G, 2, sizes=out), ref, **TOL)


@pytest.mark.world(2)
def test_pool_unsupported_raise():
    x = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ShardkitError, match="ceil_mode"):
        spatial_max_pool(x, world_group(), 3, 2, ceil_mode=True)
    with pytest.raises(ShardkitError, match="half the kernel"):
        spatial_avg_pool(x, world_group(), 3, 2, padding=2)
    with pytest.raises(ShardkitError, match="return_indices"):
        SpatialMaxPool2d(2, return_indices=True, group=world_group(), dim=3)


@pytest.mark.world(4)
def test_tiles_carry_one_groups_error_into_the_next_agreement():
    """Check mode over tiles: a disagreement inside one column's group is carried into the row
    agreement, so the ranks of the other column raise it too instead of waiting for it."""
    from harness.helpers import get_mesh
    from shardkit.comm import checks

    mesh = get_mesh((2, 2), ("h", "w"))
    x = torch.zeros(1, 2, 3, 3, dtype=torch.float32 if rank() == 0 else torch.float64)  # rank 0's tile differs
    with checks(True), pytest.raises(ShardkitError, match="disagree on dtype"):
        spatial_interpolate(x, (mesh["h"], mesh["w"]), (2, 3), 2)
