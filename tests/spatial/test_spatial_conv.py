"""Sharded convolutions: parity with the unsharded torch convolution, ledger counts, errors.

Parity: output, input gradient, weight and bias gradients against ``torch.nn.Conv*d`` on the
full tensor (float64, rtol 1e-9), gathered with :func:`shardkit.all_gather`. The grid (kernel
1-7, stride 1-3, padding 0-3 and "same", dilation 1-3, groups 1 / 2 / depthwise, every padding
mode, 1-d / 2-d / 3-d, channels first / last, every spatial dim, uneven and zero-size splits)
is sampled: a fixed pseudo-random subset per world size plus hand-picked edge cases (the edge cases
are the quick tier, the sample is the matrix tier that CI runs: harness/tiers.py, edge_and_sample).
"""

import copy
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.helpers import rank, world_group, world_size
from harness.limits import patient
from harness.tiers import edge_and_sample
from shardkit import ShardkitError, ShardkitTypeError, all_gather, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.spatial import (
    RingConv2d,
    SpatialConv2d,
    ring_conv2d,
    spatial_conv1d,
    spatial_conv2d,
    spatial_conv3d,
    spatial_output_sizes,
)

FNS = {1: spatial_conv1d, 2: spatial_conv2d, 3: spatial_conv3d}
MODULES = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SPLITS = {
    "balanced": lambda n, R: balanced_split_sizes(n, R),
    "zero_first": lambda n, R: [0] + balanced_split_sizes(n, R - 1) if R > 1 else [n],
    "ragged": lambda n, R: _ragged(n, R),
}


def _ragged(n, R):
    """A lopsided split with a zero-size shard in the middle (for R >= 3)."""
    if R == 1:
        return [n]
    sizes = [0] * R
    sizes[0] = n // 2
    sizes[-1] = n - n // 2 - (R - 2)
    for r in range(1, R - 1):
        sizes[r] = 1 if r % 2 else 0
    sizes[-1] += sum(1 for r in range(1, R - 1) if r % 2 == 0)
    return sizes


def _case(nd, shard, k, s, p, d, groups, mode, split, n, cl=False):
    """One parity case as a picklable dict. ``shard``: index of the sharded spatial dim."""
    return dict(nd=nd, shard=shard, k=k, s=s, p=p, d=d, groups=groups, mode=mode, split=split, n=n, cl=cl)


def _valid(c):
    reach = c["d"] * (c["k"] - 1)
    pads = (reach // 2, reach - reach // 2) if c["p"] == "same" else (c["p"], c["p"])
    if c["p"] == "same" and c["s"] != 1:
        return False
    if c["mode"] == "reflect" and max(pads) >= c["n"]:
        return False  # torch's limits, for the reference; shardkit raises the same (tested)
    if c["mode"] == "circular" and max(pads) > c["n"]:
        return False
    return c["n"] + sum(pads) >= reach + 1


def _sampled(R, count=56):
    rng = random.Random(1000 + R)
    cases = []
    while len(cases) < count:
        nd = rng.choice([1, 2, 2, 3])
        c = _case(
            nd,
            rng.randrange(nd),
            rng.randint(1, 7),
            rng.randint(1, 3),
            rng.choice([0, 1, 2, 3, "same"]),
            rng.randint(1, 3),
            rng.choice(["1", "2", "depthwise"]),
            rng.choice(["zeros", "zeros", "zeros", "reflect", "replicate", "circular"]),
            rng.choice(sorted(SPLITS)),
            rng.randint(R, 13),
            cl=rng.random() < 0.3,
        )
        if _valid(c):
            cases.append(c)
    return cases


EDGE = [
    _case(1, 0, 4, 1, 3, 3, "1", "zeros", "balanced", 6),  # reach 9 past shards of 1-3
    _case(2, 1, 3, 1, "same", 1, "1", "zeros", "balanced", 10),  # residual-friendly same conv
    _case(2, 1, 4, 1, "same", 2, "depthwise", "zeros", "ragged", 9),  # even kernel: asymmetric
    _case(2, 0, 3, 2, 1, 1, "1", "zeros", "balanced", 8, cl=True),  # H-shard, NHWC, downsample
    _case(2, 1, 1, 3, 0, 1, "1", "zeros", "ragged", 10),  # stride > kernel: gaps
    _case(2, 1, 2, 2, 0, 1, "2", "zeros", "balanced", 8),  # patchify: no traffic at even R
    _case(1, 0, 5, 1, 2, 1, "1", "reflect", "zero_first", 6),
    _case(1, 0, 3, 1, 3, 1, "1", "replicate", "ragged", 4),
    _case(1, 0, 3, 1, 3, 1, "1", "circular", "zero_first", 4),
    _case(3, 2, 3, 1, 1, 1, "depthwise", "circular", "balanced", 7, cl=True),
    _case(3, 0, 2, 2, 1, 1, "1", "replicate", "balanced", 6),
    _case(1, 0, 7, 3, 0, 1, "1", "zeros", "balanced", 7),  # one output: ranks without any
]

assert all(_valid(c) for c in EDGE)


def _ids(cases):
    return [
        f"{c['nd']}d-s{c['shard']}-k{c['k']}s{c['s']}p{c['p']}d{c['d']}-g{c['groups']}-{c['mode']}-{c['split']}{c['n']}"
        + ("-cl" if c["cl"] else "")
        for c in cases
    ]


def _parity(c, seed=0):
    """Run one case on every rank; returns (ok, message). Every collective runs before any check."""
    R, r, G = world_size(), rank(), world_group()
    nd, j = c["nd"], c["shard"]
    gen = torch.Generator().manual_seed(seed)
    c_in = 4 if c["groups"] != "1" else 3
    groups = {"1": 1, "2": 2, "depthwise": c_in}[c["groups"]]
    spatial = [5, 4, 4][:nd]
    spatial[j] = c["n"]
    kernel = [min(c["k"], 3)] * nd  # other dims: small kernels, full size 4-5
    kernel[j] = c["k"]
    dil = [1] * nd
    dil[j] = c["d"]
    ref = MODULES[nd](
        c_in,
        4,
        kernel,
        stride=c["s"],
        padding=c["p"],
        dilation=dil,
        groups=groups,
        padding_mode=c["mode"],
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
    with warnings.catch_warnings():  # torch notes that "same" with an even kernel pads a copy
        warnings.simplefilter("ignore")
        y_ref = ref(x_ref.movedim(-1, 1)).movedim(1, -1) if c["cl"] else ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    y_ref.backward(dy)

    sizes = SPLITS[c["split"]](c["n"], R)
    out_sizes = spatial_output_sizes(sizes, c["k"], c["s"], c["p"], c["d"])
    x = x_full.narrow(dim, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    w = ref.weight.detach().clone().requires_grad_()
    b = ref.bias.detach().clone().requires_grad_()
    y = FNS[nd](
        x, w, b, G, dim, c["s"], c["p"], tuple(dil), groups, padding_mode=c["mode"], sizes=sizes, channels_last=c["cl"]
    )
    y.backward(dy.narrow(dim, split_offsets(out_sizes)[r], out_sizes[r]))
    y_full = all_gather(y.detach(), G, dim, sizes=out_sizes)
    gx_full = all_gather(x.grad, G, dim, sizes=sizes)
    checks = {
        "local_output_size": y.shape[dim] == out_sizes[r],
        "output": torch.allclose(y_full, y_ref, rtol=1e-9, atol=1e-12),
        "input_grad": torch.allclose(gx_full, x_ref.grad, rtol=1e-9, atol=1e-12),
        "weight_grad": torch.allclose(w.grad, ref.weight.grad, rtol=1e-9, atol=1e-12),
        "bias_grad": torch.allclose(b.grad, ref.bias.grad, rtol=1e-9, atol=1e-12),
    }
    bad = [name for name, ok in checks.items() if not ok]
    return not bad, f"{c} sizes={sizes} out_sizes={out_sizes}: mismatched {bad}"


def _run(c):
    ok, msg = _parity(c)
    assert ok, msg


@pytest.mark.world(1)
@pytest.mark.parametrize("c", edge_and_sample(EDGE, _sampled(1, 8), _ids(EDGE + _sampled(1, 8))))
def test_parity_r1(c):
    _run(c)


@pytest.mark.world(2)
@pytest.mark.parametrize("c", edge_and_sample(EDGE, _sampled(2), _ids(EDGE + _sampled(2))))
def test_parity_r2(c):
    _run(c)


@pytest.mark.world(3)
@pytest.mark.parametrize("c", edge_and_sample(EDGE, _sampled(3), _ids(EDGE + _sampled(3))))
def test_parity_r3(c):
    _run(c)


@pytest.mark.world(4)
@pytest.mark.parametrize("c", edge_and_sample(EDGE, _sampled(4), _ids(EDGE + _sampled(4))))
def test_parity_r4(c):
    _run(c)


# ---------------------------------------------------------------- output-size rule (pure math)


def test_output_sizes_rule():
    # stride-1 "same": every split maps to itself (residuals line up), zero-size shards included
    for sizes in ([4, 3, 3], [0, 5, 0, 2], [1, 1], [7]):
        for k, d in ((3, 1), (4, 2), (7, 3)):
            assert spatial_output_sizes(sizes, k, 1, "same", d) == sizes
    assert spatial_output_sizes([4, 4, 4, 4], 3, 2, 1) == [2, 2, 2, 2]  # even downsample
    assert spatial_output_sizes([4, 4, 4, 4], 2, 2, 0) == [2, 2, 2, 2]  # patchify
    assert spatial_output_sizes([5, 0, 5], 7, 1, 3) == [5, 0, 5]
    assert spatial_output_sizes([3, 3], 3, 1, 0) == [2, 2]  # valid: centre of output o is o + 1
    assert spatial_output_sizes([3, 4], 1, 1, (2, 1)) == [5, 5]  # padding-only outputs go to the ends
    for sizes, k, s, p, d in (([2, 0, 5, 1], 3, 2, 1, 1), ([6, 1, 0, 6], 5, 3, 2, 2), ([9], 4, 1, 0, 1)):
        n = sum(sizes)
        assert sum(spatial_output_sizes(sizes, k, s, p, d)) == (n + 2 * p - d * (k - 1) - 1) // s + 1


@pytest.mark.parametrize(
    "args, kind, fragment",
    [
        (([3, 3], 9), ShardkitError, "larger than the padded"),
        (([3, 3], 3, 2, "same"), ShardkitError, "same"),
        (([3, -1], 3), ShardkitError, ">= 0"),
        (([3, 3], 0), ShardkitError, ">= 1"),
        (([3, 3], 3, 1.0), ShardkitTypeError, "stride"),
        (([], 3), ShardkitTypeError, "non-empty"),
    ],
)
def test_output_sizes_errors(args, kind, fragment):
    with pytest.raises(kind, match=fragment):
        spatial_output_sizes(*args)


# ---------------------------------------------------------------- ledger


def _conv_ledger(x_grad=True, sum_param_grads=True, k=3, s=1, p=1, bias=True):
    r = rank()
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64).requires_grad_(x_grad)  # W = 4 on each rank
    w = torch.randn(4, 3, k, k, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True) if bias else None
    with CommLedger() as ledger:
        y = spatial_conv2d(x, w, b, world_group(), -1, s, p, sum_param_grads=sum_param_grads)
        y.sum().backward()
    assert y.shape[-1] == spatial_output_sizes([4] * world_size(), k, s, p)[r]
    assert w.grad is not None and (b is None or b.grad is not None)
    return ledger


@pytest.mark.world(2)
def test_ledger_conv_forward_backward_exact():
    ledger = _conv_ledger()
    assert ledger.count(op="all_to_all_single", api="spatial_conv2d", phase="forward") == 1
    assert ledger.count(op="all_to_all_single", api="spatial_conv2d", phase="backward") == 1
    assert ledger.count(op="all_reduce", api="spatial_conv2d", phase="backward") == 1  # weight + bias fused
    assert ledger.count(op="metadata_all_gather", phase="metadata") == 1  # no sizes=: learned
    assert ledger.count() == 4
    column = 2 * 3 * 5 * 8  # one W column of [B=2, C=3, H=5] float64: the neighbour's border
    assert ledger.bytes_received(op="all_to_all_single", phase="forward") == column
    assert ledger.bytes_sent(op="all_to_all_single", phase="backward") == column
    assert ledger.bytes_sent(op="all_reduce") == (4 * 3 * 3 * 3 + 4) * 8


@pytest.mark.world(3)
def test_ledger_conv_variants():
    # input without gradient (first layer): no backward exchange
    ledger = _conv_ledger(x_grad=False)
    assert ledger.count(phase="forward") == 1 and ledger.count(phase="backward") == 1
    assert ledger.count(op="all_reduce", phase="backward") == 1
    # parameter gradients left partial for the caller to sum
    ledger = _conv_ledger(sum_param_grads=False)
    assert ledger.count(op="all_reduce") == 0 and ledger.count(op="all_to_all_single") == 2
    # patchify (kernel == stride, no padding, shards divisible): no halo at all
    ledger = _conv_ledger(k=2, s=2, p=0)
    assert ledger.count(op="all_to_all_single") == 0 and ledger.count(op="all_reduce") == 1
    # no bias: the weight gradient alone is all-reduced
    ledger = _conv_ledger(bias=False)
    assert ledger.bytes_sent(op="all_reduce") == 4 * 3 * 3 * 3 * 8
    # no autograd: one forward exchange only
    with CommLedger() as ledger, torch.no_grad():
        spatial_conv2d(torch.randn(1, 3, 4, 4), torch.randn(2, 3, 3, 3), None, world_group(), 3, padding=1)
    assert ledger.count() == 2 and ledger.count(phase="metadata") == 1


# ---------------------------------------------------------------- layers


@pytest.mark.world(3)
def test_layers_match_nn_conv_and_share_parameters():
    R, r, G = world_size(), rank(), world_group()
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
    sizes = balanced_split_sizes(8, R)
    full = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    local = full.narrow(3, split_offsets(sizes)[r], sizes[r])
    layers = {
        "spatial": SpatialConv2d(3, 4, 3, padding=1, group=G, dim=3, dtype=torch.float64),
        "from_conv": SpatialConv2d.from_conv(conv, G, dim=3),
        "ring": RingConv2d(3, 4, 3, padding=1, group=G, dtype=torch.float64),
    }
    assert layers["from_conv"].weight is conv.weight and layers["from_conv"].bias is conv.bias
    assert set(layers["spatial"].state_dict()) == set(conv.state_dict())
    for name in ("spatial", "ring"):
        layers[name].load_state_dict(conv.state_dict())
    for name, layer in layers.items():
        y = all_gather(layer(local, sizes=sizes).detach(), G, 3, sizes=sizes)
        assert torch.allclose(y, conv(full), rtol=1e-9, atol=1e-12), name
    nhwc = RingConv2d.from_conv(conv, G, data_format="NHWC")
    y = nhwc(local.permute(0, 2, 3, 1), sizes=sizes)
    assert torch.allclose(
        all_gather(y.detach(), G, 2, sizes=sizes), conv(full).permute(0, 2, 3, 1), rtol=1e-9, atol=1e-12
    )
    y = ring_conv2d(local, conv.weight, conv.bias, 1, 1, group=G, sizes=sizes)
    assert torch.allclose(all_gather(y.detach(), G, 3, sizes=sizes), conv(full), rtol=1e-9, atol=1e-12)
    assert "dim=3" in repr(layers["spatial"])


@pytest.mark.world(3)
def test_stack_with_residual_sizes_flow_through():
    # same conv -> residual add on the input shards -> strided conv, over a split with an empty rank
    r, G = rank(), world_group()
    torch.manual_seed(0)
    ref1, ref2 = (
        nn.Conv2d(3, 3, 3, padding=1, dtype=torch.float64),
        nn.Conv2d(3, 5, 4, stride=2, padding=1, dtype=torch.float64),
    )
    c1, c2 = SpatialConv2d.from_conv(copy.deepcopy(ref1), G, 3), SpatialConv2d.from_conv(copy.deepcopy(ref2), G, 3)
    sizes, full = [5, 0, 4], torch.randn(2, 3, 6, 9, dtype=torch.float64)
    out_sizes = spatial_output_sizes(sizes, 4, 2, 1)
    dy = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    x = full.narrow(3, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    y = c2(x + torch.relu(c1(x, sizes=sizes)), sizes=sizes)
    (y * dy.narrow(3, split_offsets(out_sizes)[r], out_sizes[r])).sum().backward()
    full.requires_grad_()
    (ref2(full + torch.relu(ref1(full))) * dy).sum().backward()
    y_full = all_gather(y.detach(), G, 3, sizes=out_sizes)
    gx_full = all_gather(x.grad, G, 3, sizes=sizes)
    assert torch.allclose(y_full, ref2(full + torch.relu(ref1(full))), rtol=1e-9, atol=1e-12)
    assert torch.allclose(gx_full, full.grad, rtol=1e-9, atol=1e-12)
    for mine, theirs in ((c1, ref1), (c2, ref2)):
        assert torch.allclose(mine.weight.grad, theirs.weight.grad, rtol=1e-9, atol=1e-12)
        assert torch.allclose(mine.bias.grad, theirs.bias.grad, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- errors


def _error_cases():
    G = world_group()
    R = world_size()
    x = torch.zeros(1, 3, 4, 2)
    w = torch.zeros(4, 3, 3, 3)
    return {
        "same_with_stride": (ShardkitError, "same", lambda: spatial_conv2d(x, w, None, G, 3, 2, "same")),
        "dim_not_spatial": (ShardkitError, "not a spatial dim", lambda: spatial_conv2d(x, w, None, G, 1)),
        "channels": (ShardkitError, "channels", lambda: spatial_conv2d(x, torch.zeros(4, 2, 3, 3), None, G, 3)),
        "bias_shape": (ShardkitError, "bias", lambda: spatial_conv2d(x, w, torch.zeros(3), G, 3)),
        "input_ndim": (ShardkitError, "4-d", lambda: spatial_conv2d(x[0], w, None, G, 2)),
        "kernel_too_large": (
            ShardkitError,
            "larger than the padded",
            lambda: spatial_conv2d(x, torch.zeros(4, 3, 1, 9), None, G, 3, sizes=[2] * R),
        ),
        "reflect_wider_than_input": (
            ShardkitError,
            "reflect",
            lambda: spatial_conv1d(
                torch.zeros(1, 3, 1), torch.zeros(4, 3, 3), None, G, 2, padding=R, padding_mode="reflect", sizes=[1] * R
            ),
        ),
        "padding_mode": (
            ShardkitError,
            "padding_mode",
            lambda: spatial_conv2d(x, w, None, G, 3, padding_mode="mirror"),
        ),
        "stride_zero": (ShardkitError, ">= 1", lambda: spatial_conv2d(x, w, None, G, 3, 0)),
        "sizes_wrong_length": (ShardkitError, "entries", lambda: spatial_conv2d(x, w, None, G, 3, sizes=[2] * (R + 1))),
        "data_format": (ShardkitError, "data_format", lambda: ring_conv2d(x, w, data_format="NCDHW", group=G)),
        "group_none": (ShardkitTypeError, "group is required", lambda: spatial_conv2d(x, w, None, None, 3)),
    }


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "case",
    [
        "same_with_stride",
        "dim_not_spatial",
        "channels",
        "bias_shape",
        "input_ndim",
        "kernel_too_large",
        "reflect_wider_than_input",
        "padding_mode",
        "stride_zero",
        "sizes_wrong_length",
        "data_format",
        "group_none",
    ],
)
def test_bad_arguments_raise_on_every_rank(case):
    kind, fragment, fn = _error_cases()[case]
    start = time.monotonic()
    with pytest.raises(kind, match=fragment) as info:
        fn()
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    outcomes = [None] * world_size()
    dist.all_gather_object(outcomes, str(info.value), group=world_group())
    assert all(o == outcomes[0] for o in outcomes), outcomes
    t = torch.ones(1)
    dist.all_reduce(t, group=world_group())  # the group is still usable
    assert t.item() == world_size()


@pytest.mark.world(2)
def test_check_mode_catches_a_size_one_rank_disagrees_on():
    from shardkit import RankMismatchError
    from shardkit.comm import checks

    x = torch.zeros(1, 3, 4, [3, 2][rank()])
    with checks(True), pytest.raises(RankMismatchError, match="local sizes"):
        spatial_conv2d(x, torch.zeros(4, 3, 3, 3), None, world_group(), 3, padding=1, sizes=[3, 3])
