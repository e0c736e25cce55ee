"""Overlapped sharded convolution (interior computed while the halos travel) against the sequential path.

Both paths (``overlap=True``, the default, and ``overlap=False``) must match the unsharded torch
convolution (float64, rtol 1e-9: output, input, weight and bias gradients), take the overlapped
path where it applies (counted), and use exactly the same collectives and bytes (zeros mode).
The interior rule itself is checked against its definition by brute force.
"""

import random

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from shardkit import all_gather, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.spatial import _overlap, spatial_conv1d, spatial_conv2d, spatial_conv3d, spatial_output_sizes
from shardkit.spatial import conv as conv_module
from shardkit.spatial._sizes import output_bounds

FNS = {1: spatial_conv1d, 2: spatial_conv2d, 3: spatial_conv3d}
MODULES = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
TOL = dict(rtol=1e-9, atol=1e-12)


def test_interior_split_matches_its_definition():
    rng = random.Random(5)
    for _ in range(3000):
        k, s, d, p = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 3), rng.randint(0, 3)
        sizes = [rng.randint(0, 9) for _ in range(rng.randint(1, 4))]
        n_in = sum(sizes)
        if n_in + 2 * p < d * (k - 1) + 1:
            continue
        bounds = output_bounds(sizes, k, s, d, (p, p))
        for r, (off, n) in enumerate(zip(split_offsets(sizes), sizes)):
            lo, hi = bounds[r], bounds[r + 1]
            inside = [o for o in range(lo, hi) if off <= o * s - p and o * s - p + d * (k - 1) < off + n]
            sp = _overlap.interior_split(lo, hi, off, n, k, s, d, p)
            if not inside:
                assert sp is None, (sizes, k, s, d, p, r)
                continue
            assert (sp.n_left, sp.n_int, sp.n_right) == (inside[0] - lo, len(inside), hi - 1 - inside[-1])
            assert sp.int_start == inside[0] * s - p - off  # local position of the first interior window
            assert sp.int_start + sp.int_len == inside[-1] * s - p + d * (k - 1) + 1 - off
            a = lo * s - p  # the request starts at the first output's window
            if sp.n_left:
                assert sp.left_len == (inside[0] - 1) * s - p + d * (k - 1) + 1 - a
            assert sp.right_lo == (inside[-1] + 1) * s - p - a


# (nd, sharded spatial index, k, s, p, d, groups, padding_mode, split, n, channels_last)
CASES = [
    (2, 1, 3, 1, 1, 1, 1, "zeros", "balanced", 17, False),  # the common 3x3 same conv
    (2, 0, 3, 2, 1, 1, 1, "zeros", "balanced", 16, True),  # stride-2 downsample, H, NHWC
    (2, 1, 3, 1, 2, 2, 2, "zeros", "uneven", 19, False),  # dilated, grouped
    (1, 0, 5, 1, "same", 1, 1, "reflect", "uneven", 21, False),  # reflect at the global borders
    (1, 0, 4, 1, "same", 2, 1, "zeros", "balanced", 32, False),  # even kernel: asymmetric halos
    (2, 1, 3, 1, 1, 1, "dw", "circular", "balanced", 15, False),  # periodic, depthwise, other dim padded
    (2, 1, 5, 1, 2, 1, 1, "replicate", "zero_mid", 18, False),  # an empty shard in the middle
    (3, 2, 3, 1, 1, 1, 1, "zeros", "balanced", 12, True),  # 3-d, NDHWC
    (1, 0, 7, 3, 3, 1, 1, "zeros", "balanced", 40, False),  # wide kernel, stride 3
    (2, 1, 3, 1, 0, 1, 1, "zeros", "balanced", 16, False),  # valid: no global padding
]


def _sizes(kind, n, R):
    if kind == "balanced" or R == 1:
        return balanced_split_sizes(n, R)
    if kind == "uneven":
        sizes = [n // R + (3 if r == 0 else 0) for r in range(R)]
        sizes[-1] = n - sum(sizes[:-1])
        return sizes
    sizes = balanced_split_sizes(n, R - 1)  # zero_mid
    return sizes[:1] + [0] + sizes[1:]


def _run(case, overlap, seed=0):
    """This rank's (ok flags, number of overlapped calls) for one case and path."""
    R, r, G = world_size(), rank(), world_group()
    nd, j, k, s, p, d, groups, mode, split, n, cl = case
    gen = torch.Generator().manual_seed(seed)
    c_in = 4
    groups = c_in if groups == "dw" else groups
    spatial = [6, 5, 4][:nd]
    spatial[j] = n
    ref = MODULES[nd](
        c_in,
        4,
        [k if i == j else 3 for i in range(nd)],
        stride=s,
        padding=p,
        groups=groups,
        dilation=[d if i == j else 1 for i in range(nd)],
        padding_mode=mode,
        dtype=torch.float64,
    )
    with torch.no_grad():
        for t in (ref.weight, ref.bias):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64))
    x_full = torch.randn([2, c_in, *spatial], generator=gen, dtype=torch.float64)
    dim = 2 + j
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    y_ref.backward(dy)
    if cl:  # the same data, channels last
        x_full, dy, y_ref, dim = x_full.movedim(1, -1), dy.movedim(1, -1), y_ref.movedim(1, -1), 1 + j
    sizes = _sizes(split, n, R)
    out_sizes = spatial_output_sizes(sizes, k, s, p, d)
    x = x_full.narrow(dim, split_offsets(sizes)[r], sizes[r]).clone().requires_grad_()
    w, b = (t.detach().clone().requires_grad_() for t in (ref.weight, ref.bias))
    calls = []
    original = conv_module.overlapped_conv
    conv_module.overlapped_conv = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        y = FNS[nd](
            x,
            w,
            b,
            G,
            dim,
            s,
            p,
            tuple(ref.dilation),
            groups,
            padding_mode=mode,
            sizes=sizes,
            channels_last=cl,
            overlap=overlap,
        )
        y.backward(dy.narrow(dim, split_offsets(out_sizes)[r], out_sizes[r]))
    finally:
        conv_module.overlapped_conv = original
    gx_ref = x_ref.grad.movedim(1, -1) if cl else x_ref.grad
    ok = {
        "output": torch.allclose(all_gather(y.detach(), G, dim, sizes=out_sizes), y_ref, **TOL),
        "input_grad": torch.allclose(all_gather(x.grad, G, dim, sizes=sizes), gx_ref, **TOL),
        "weight_grad": torch.allclose(w.grad, ref.weight.grad, **TOL),
        "bias_grad": torch.allclose(b.grad, ref.bias.grad, **TOL),
    }
    return ok, len(calls)


def _check_both_paths(case):
    ok_seq, calls_seq = _run(case, overlap=False)
    ok_ovl, calls_ovl = _run(case, overlap=True)
    bad = [f"sequential {k}" for k, v in ok_seq.items() if not v] + [f"overlap {k}" for k, v in ok_ovl.items() if not v]
    assert all_true(not bad), f"rank {rank()}: {bad}"
    assert calls_seq == 0
    # Every rank with interior outputs and some halo traffic in the group takes the overlapped path.
    used = torch.tensor([calls_ovl])
    torch.distributed.all_reduce(used, group=world_group())
    return used.item()


@pytest.mark.world(1)
@pytest.mark.parametrize("case", CASES[:4])
def test_both_paths_r1(case):
    # One rank: no traffic (circular wraps locally), so the sequential path always runs.
    assert _check_both_paths(case) == 0


@pytest.mark.world(2)
@pytest.mark.parametrize("case", CASES)
def test_both_paths_r2(case):
    used = _check_both_paths(case)
    # zero_mid at R = 2 is [18, 0]: rank 0 reads nothing remote and rank 1 nothing at all.
    assert used == 0 if case[8] == "zero_mid" else used >= 1


@pytest.mark.world(3)
@pytest.mark.parametrize("case", CASES)
def test_both_paths_r3(case):
    assert _check_both_paths(case) >= 1


@pytest.mark.world(4)
@pytest.mark.parametrize("case", CASES)
def test_both_paths_r4(case):
    assert _check_both_paths(case) >= 1


@pytest.mark.world(2)
@pytest.mark.parametrize("x_grad", [True, False])
def test_overlap_uses_the_same_collectives(x_grad):
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64).requires_grad_(x_grad)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    records = {}
    for overlap in (False, True):
        with CommLedger() as ledger:
            y = spatial_conv2d(x, w, b, world_group(), 3, padding=1, overlap=overlap)
            y.sum().backward()
        records[overlap] = sorted((c.op, c.api, c.phase, c.bytes_sent, c.bytes_received) for c in ledger.records)
    assert records[True] == records[False]
    assert sum(1 for c in records[True] if c[0] == "all_to_all_single") == (2 if x_grad else 1)
    with torch.no_grad(), CommLedger() as ledger:  # no autograd: forward exchange only, still overlapped
        y = spatial_conv2d(x, w, b, world_group(), 3, padding=1)
    assert ledger.count(phase="metadata") == 1  # the split is learned (no sizes=)
    assert ledger.count() == 2 and y.shape == (2, 4, 5, 6)
