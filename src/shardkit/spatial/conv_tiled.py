"""Convolutions over an input sharded along several spatial dims at once (tiles on a mesh).

A 2-D mesh ``("h", "w")`` holds ``H x W`` tiles: rank ``(i, j)`` holds rows ``i`` and columns
``j`` of the split. The halo is exchanged one dim at a time: first along H over the ``"h"``
group, then along W over the ``"w"`` group *on the H-extended block*. All ranks of one ``"w"``
group hold the same rows, so they extend them identically, and the second exchange carries the
corner elements. Each exchange is the one-``all_to_all_single`` plan of :mod:`.halo` with the
global border mode of its dim, which also reproduces torch's padding order in the corners
(reflect / replicate / circular pad one dim after another). The local convolution then runs
without padding on the sharded dims.

The weight and bias are replicated over the whole mesh, so their gradients are summed over
each group in turn (sum over ``"w"``, then over ``"h"``: the sum over all tiles).

Collectives per call: forward one ``all_to_all_single`` per sharded dim (none where no rank
needs a neighbour element); backward the same when the input needs a gradient, plus one
``all_reduce`` of the fused parameter gradients per sharded dim.
"""

from __future__ import annotations

import torch

from ..comm._validate import dim_of, enter, expected_size, local_sizes, maybe_agree
from ..errors import ShardkitError
from ._conv_core import _local_conv, _SumParamGrads, conv_geometry
from ._meta import keep_graph_empty
from ._sizes import (
    check_out_len,
    conv_out_len,
    geometry_args,
    input_ranges,
    output_bounds,
)
from .halo import exchange, plan_for

__all__ = ["tiled_conv"]


def _pairs(value, k: int, name: str, op: str):
    if not isinstance(value, (tuple, list)) or len(value) != k:
        raise ShardkitError(f"{op}: with {k} sharded dims, {name} must be a sequence of {k} entries, got {value!r}")
    return list(value)


def tile_entry(nd: int, op: str, x, group, dim, sizes, channels_last: bool, extra=()):
    """Shared argument checks of the tiled convolutions (one group and one dim per tiled axis).

    ``extra``: further arguments every rank must agree on in check mode (the geometry).

    Returns:
        ``(dims, k, infos, xc, dcs, sizes)``: the user dims, their count, the resolved groups,
        the channels-first input, its tiled dims, and every rank's size along each tiled axis
        (given, or learned with one metadata all-gather per axis).
    """
    dims = _pairs(dim, len(dim), "dim", op)
    k = len(dims)
    grps = _pairs(group, k, "group", op)
    all_sizes = [None] * k if sizes is None else _pairs(sizes, k, "sizes", op)
    infos = [enter(x, gr, op) for gr in grps]
    known = [
        maybe_agree(
            g,
            op,
            x,
            (dm, int(bool(channels_last)), int(x.requires_grad), sz, *extra),
            local_dim=dm,
            expected_local=expected_size(sz, g.rank),
        )
        for g, dm, sz in zip(infos, dims, all_sizes)
    ]
    if x.dim() != nd + 2:
        raise ShardkitError(f"{op}: expected a {nd + 2}-d input, got shape {tuple(x.shape)}")
    ds = [dim_of(x, dm, op) for dm in dims]
    spatial = list(range(1, nd + 1)) if channels_last else list(range(2, nd + 2))
    if any(d not in spatial for d in ds) or len(set(ds)) != k:
        raise ShardkitError(f"{op}: dims {dims} must be distinct spatial dims (spatial dims {spatial})")
    xc = x.movedim(-1, 1) if channels_last else x
    dcs = [d + 1 if channels_last else d for d in ds]
    all_sizes = [local_sizes(xc, g, dc, sz, op, kn) for g, dc, sz, kn in zip(infos, dcs, all_sizes, known)]
    return dims, k, infos, xc, dcs, all_sizes


def tiled_conv(
    nd,
    op,
    x,
    weight,
    bias,
    group,
    dim,
    stride,
    padding,
    dilation,
    groups,
    padding_mode,
    sizes,
    channels_last,
    sum_param_grads,
):
    """:func:`spatial_conv2d` / :func:`spatial_conv3d` when ``dim`` and ``group`` are sequences."""
    extra = geometry_args(weight, bias, stride, padding, dilation, groups, padding_mode)
    dims, k, infos, xc, dcs, all_sizes = tile_entry(nd, op, x, group, dim, sizes, channels_last, extra)
    kernel, stride, dilation, pads = conv_geometry(
        xc, weight, bias, groups, nd, stride, padding, dilation, padding_mode, op
    )
    lens = list(xc.shape[2:])
    for dc, sz in zip(dcs, all_sizes):
        lens[dc - 2] = sum(sz)
    for i in range(nd):
        check_out_len(lens[i], kernel[i], stride[i], dilation[i], pads[i], op, max(g.size for g in infos))
    seg, n_out = xc, {}
    for g, dc, sz in zip(infos, dcs, all_sizes):  # one dim after another: the later exchanges carry the corners
        j = dc - 2
        geometry = (kernel[j], stride[j], dilation[j], pads[j])
        seg = exchange(seg, g, dc, plan_for(op, sz, input_ranges(sz, *geometry), padding_mode), op)
        bounds = output_bounds(sz, *geometry)
        n_out[j] = bounds[g.rank + 1] - bounds[g.rank]
    params = [p for p in (weight, bias) if p is not None]
    if sum_param_grads and torch.is_grad_enabled() and any(p.requires_grad for p in params):
        for g in infos:
            if g.size > 1:
                params = _SumParamGrads.apply(g, op, *params)
        weight, bias = params[0], (params[1] if bias is not None else None)
    if any(v == 0 for v in n_out.values()):
        out_lens = [n_out.get(i, conv_out_len(lens[i], kernel[i], stride[i], dilation[i], pads[i])) for i in range(nd)]
        deps = [t for t in (seg, weight, bias) if t is not None]
        out = keep_graph_empty([xc.shape[0], weight.shape[0], *out_lens], *deps)
    else:
        other = [(0, 0) if (2 + i) in dcs else p for i, p in enumerate(pads)]
        j0 = dcs[0] - 2  # _local_conv leaves one dim unpadded; the others come from ``other``
        out = _local_conv(nd, seg, weight, bias, j0, stride, dilation, groups, other, padding_mode)
    return out.movedim(1, -1) if channels_last else out
