"""Transposed convolutions over an input sharded along several spatial dims at once (tiles on a mesh).

As :mod:`.conv_tiled` for convolutions: a 2-D mesh ``("h", "w")`` holds ``H x W`` tiles; the
inputs that reach a rank's outputs (:func:`.conv_transpose.transpose_input_ranges`, zeros
outside the frame) are fetched one dim after another, first along H over the ``"h"`` group,
then along W over the ``"w"`` group on the H-extended block (which carries the corners). One
local ``torch`` transposed convolution with no padding on the sharded dims follows, and each
sharded dim is cropped to this rank's outputs (the output rule of :mod:`.conv_transpose`, per
dim). Weight and bias are replicated over the whole mesh: their gradients are summed over each
group in turn.

Collectives per call: forward one ``all_to_all_single`` per sharded dim (none where no rank
needs a neighbour element); backward the same when the input needs a gradient, plus one
``all_reduce`` of the fused parameter gradients per sharded dim.
"""

from __future__ import annotations

import torch

from ._conv_core import _SumParamGrads
from ._meta import keep_graph_empty
from ._sizes import geometry_args, per_dim
from ._transpose_core import (
    _CONVT,
    _check_geometry,
    _check_weight,
    transpose_bounds,
    transpose_input_ranges,
    transpose_out_len,
)
from .conv_tiled import tile_entry
from .halo import exchange, plan_for

__all__ = ["tiled_conv_transpose"]


def tiled_conv_transpose(
    nd,
    op,
    x,
    weight,
    bias,
    group,
    dim,
    stride,
    padding,
    output_padding,
    groups,
    dilation,
    sizes,
    channels_last,
    sum_param_grads,
):
    """:func:`spatial_conv_transpose2d` / ``3d`` when ``dim`` and ``group`` are sequences."""

    extra = geometry_args(weight, bias, stride, padding, dilation, groups, output_padding)
    dims, k, infos, xc, dcs, all_sizes = tile_entry(nd, op, x, group, dim, sizes, channels_last, extra)
    _check_weight(xc, weight, bias, groups, nd, op)
    kernel = tuple(weight.shape[2:])
    stride, dilation = per_dim(stride, nd, "stride", op, 1), per_dim(dilation, nd, "dilation", op, 1)
    padding, output_padding = (
        per_dim(padding, nd, "padding", op, 0),
        per_dim(output_padding, nd, "output_padding", op, 0),
    )
    lens = list(xc.shape[2:])
    for dc, sz in zip(dcs, all_sizes):
        lens[dc - 2] = sum(sz)
    for i in range(nd):
        _check_geometry(
            lens[i], kernel[i], stride[i], padding[i], dilation[i], output_padding[i], op, max(g.size for g in infos)
        )
    seg, crops = xc, {}
    for g, dc, sz in zip(infos, dcs, all_sizes):  # one dim after another: the later exchanges carry the corners
        j = dc - 2
        geometry = (kernel[j], stride[j], padding[j], dilation[j], output_padding[j])
        ranges = transpose_input_ranges(sz, *geometry)
        seg = exchange(seg, g, dc, plan_for(op, sz, ranges, "zeros"), op)
        bounds = transpose_bounds(sz, *geometry)
        lo, hi = bounds[g.rank], bounds[g.rank + 1]
        crops[dc] = (lo + padding[j] - ranges[g.rank][0] * stride[j], hi - lo)  # local output 0 is a*s - p
    params = [t for t in (weight, bias) if t is not None]
    if sum_param_grads and torch.is_grad_enabled() and any(t.requires_grad for t in params):
        for g in infos:
            if g.size > 1:
                params = _SumParamGrads.apply(g, op, *params)
        weight, bias = params[0], (params[1] if bias is not None else None)
    c_out = weight.shape[1] * groups
    if any(n == 0 for _, n in crops.values()):
        out_lens = [
            crops[2 + i][1]
            if (2 + i) in crops
            else transpose_out_len(lens[i], kernel[i], stride[i], padding[i], dilation[i], output_padding[i])
            for i in range(nd)
        ]
        out = keep_graph_empty([xc.shape[0], c_out, *out_lens], *[t for t in (seg, weight, bias) if t is not None])
    else:
        pad = tuple(0 if (2 + i) in crops else v for i, v in enumerate(padding))
        opad = tuple(0 if (2 + i) in crops else v for i, v in enumerate(output_padding))
        out = _CONVT[nd](seg, weight, bias, stride, pad, opad, groups, dilation)
        for dc, (start, n) in crops.items():
            out = out.narrow(dc, start, n)
    return out.movedim(1, -1) if channels_last else out
