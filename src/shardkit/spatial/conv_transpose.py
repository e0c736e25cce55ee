"""Transposed convolutions over an input sharded along one spatial dim.

Along the sharded dim (global input size ``N``, kernel ``k``, stride ``s``, padding ``p``,
dilation ``d``, output padding ``q``) input ``i`` and tap ``j`` add into output
``o = i*s - p + j*d``; the output has ``L = (N-1)*s - 2p + d*(k-1) + q + 1`` elements.

**Output rule.** The adjoint of the window-centre rule of :mod:`._sizes`: output ``o`` belongs
to the rank holding input ``floor((o + p - (d*(k-1)) // 2) / s)`` (the input whose stride-``s``
window centre lands on ``o``), clamped to ranks 0 and ``R-1`` at the borders. So an even split
of ``N`` upsampled by ``k = 2s, p = s/2`` or ``k = s, p = 0`` gives ``s * sizes``, and a
stride-1 ``"same"``-like transposed conv (``k = 2p + 1``) keeps the split, as for convolutions.

Each rank fetches (one halo exchange, zeros outside ``[0, N)``) the inputs that reach its
outputs, runs a local ``torch`` transposed convolution with no padding on the sharded dim and
crops its outputs. Weight and bias are replicated; their gradients are summed over the group
in backward (one fused all-reduce), as :mod:`.conv`.

Source: the transposed convolution as the adjoint of a strided convolution (Dumoulin & Visin,
"A guide to convolution arithmetic for deep learning", 2016), sharded as in :mod:`.conv`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .._shapes import check_split_sizes
from ..comm._validate import dim_of, enter, expected_size, local_sizes, maybe_agree
from ..errors import ShardkitError, ShardkitTypeError
from ._conv_core import _EmptyOutput, _SumParamGrads
from ._meta import channels_first
from ._sizes import geometry_args, per_dim
from ._transpose_core import (
    _CONVT,
    _check_geometry,
    _check_weight,
    transpose_bounds,
    transpose_input_ranges,
    transpose_out_len,
)
from .conv_transpose_tiled import tiled_conv_transpose
from .halo import exchange, plan_for

if TYPE_CHECKING:
    from .._types import Group

__all__ = [
    "spatial_conv_transpose1d",
    "spatial_conv_transpose2d",
    "spatial_conv_transpose3d",
    "spatial_transpose_output_sizes",
]


def spatial_transpose_output_sizes(
    in_sizes: Sequence[int],
    kernel_size: int,
    stride: int = 1,
    padding: int = 0,
    output_padding: int = 0,
    dilation: int = 1,
) -> list[int]:
    """Per-rank output sizes of a transposed convolution sharded along one spatial dim.

    A pure function of the input split (output rule of :mod:`.conv_transpose`), e.g.
    ``spatial_transpose_output_sizes([4, 4], 4, stride=2, padding=1) == [8, 8]``.

    Raises:
        ShardkitError: bad sizes or arguments, or an output length < 1.
        ShardkitTypeError: non-int arguments.
    """
    op = "spatial_transpose_output_sizes"
    if isinstance(in_sizes, (str, bytes)) or not isinstance(in_sizes, Sequence) or not in_sizes:
        raise ShardkitTypeError(f"{op}: in_sizes must be a non-empty sequence of ints, got {in_sizes!r}")
    sizes = check_split_sizes(in_sizes, len(in_sizes), None, op)
    (k,), (s,), (d,) = (
        per_dim(v, 1, n, op, 1) for v, n in ((kernel_size, "kernel_size"), (stride, "stride"), (dilation, "dilation"))
    )
    (p,), (q,) = per_dim(padding, 1, "padding", op, 0), per_dim(output_padding, 1, "output_padding", op, 0)
    _check_geometry(sum(sizes), k, s, p, d, q, op, len(sizes))
    b = transpose_bounds(sizes, k, s, p, d, q)
    return [hi - lo for lo, hi in zip(b[:-1], b[1:])]


def _spatial_conv_transpose(
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
    if isinstance(dim, (tuple, list)):  # several sharded dims (tiles on a mesh)
        return tiled_conv_transpose(
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
        )
    g = enter(x, group, op)
    known = maybe_agree(
        g,
        op,
        x,
        (
            dim,
            int(bool(channels_last)),
            int(x.requires_grad),
            sizes,
            *geometry_args(weight, bias, stride, padding, dilation, groups, output_padding),
        ),
        local_dim=dim,
        expected_local=expected_size(sizes, g.rank),
    )
    if x.dim() != nd + 2:
        raise ShardkitError(f"{op}: expected a {nd + 2}-d input, got shape {tuple(x.shape)}")
    d = dim_of(x, dim, op)
    xc, dc = channels_first(x, d, nd, channels_last, dim, op)
    j = dc - 2
    _check_weight(xc, weight, bias, groups, nd, op)
    kernel = tuple(weight.shape[2:])
    stride, dilation = per_dim(stride, nd, "stride", op, 1), per_dim(dilation, nd, "dilation", op, 1)
    padding, output_padding = (
        per_dim(padding, nd, "padding", op, 0),
        per_dim(output_padding, nd, "output_padding", op, 0),
    )
    sizes = local_sizes(xc, g, dc, sizes, op, known)
    lens = [sum(sizes) if i == j else xc.shape[2 + i] for i in range(nd)]
    for i in range(nd):
        _check_geometry(lens[i], kernel[i], stride[i], padding[i], dilation[i], output_padding[i], op, g.size)
    geometry = (kernel[j], stride[j], padding[j], dilation[j], output_padding[j])
    ranges = transpose_input_ranges(sizes, *geometry)
    x_seg = exchange(xc, g, dc, plan_for(op, sizes, ranges, "zeros"), op)
    params = [t for t in (weight, bias) if t is not None]
    if sum_param_grads and g.size > 1 and torch.is_grad_enabled() and any(t.requires_grad for t in params):
        params = _SumParamGrads.apply(g, op, *params)
        weight, bias = params[0], (params[1] if bias is not None else None)
    bounds = transpose_bounds(sizes, *geometry)
    lo, hi = bounds[g.rank], bounds[g.rank + 1]
    if hi == lo:
        out_lens = [
            0
            if i == j
            else transpose_out_len(lens[i], kernel[i], stride[i], padding[i], dilation[i], output_padding[i])
            for i in range(nd)
        ]
        out = _EmptyOutput.apply([xc.shape[0], weight.shape[1] * groups, *out_lens], x_seg, weight, bias)
    else:
        pad = tuple(0 if i == j else v for i, v in enumerate(padding))
        opad = tuple(0 if i == j else v for i, v in enumerate(output_padding))
        y = _CONVT[nd](x_seg, weight, bias, stride, pad, opad, groups, dilation)
        # local output 0 is global output a*s - p
        out = y.narrow(dc, lo + padding[j] - ranges[g.rank][0] * stride[j], hi - lo)
    return out.movedim(1, -1) if channels_last else out


_DOC = """Transposed convolution of an input sharded along spatial dim ``dim``; output sharded along it too.

    Forward: halo exchange of the inputs that reach this rank's outputs, then a local
    ``torch`` transposed convolution and a crop; backward: the reverse exchange adds halo
    gradients into their owners and the weight / bias gradients are summed over the group.

    Args:
        x_local: ``[B, C_in, *S_local]`` (``[B, *S_local, C_in]`` with ``channels_last``).
        weight: ``[C_in, C_out / groups, *K]`` (torch's transposed layout), replicated.
        bias: ``[C_out]`` or None, replicated.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sharded spatial dim of ``x_local`` (negative allowed).
        stride: an int or one per spatial dim, as torch.
        padding: an int or one per spatial dim, as torch.
        output_padding: an int or one per spatial dim, as torch (< stride or dilation).
        dilation: an int or one per spatial dim, as torch.
        groups: as torch.
        sizes: every rank's input size along ``dim`` (uneven and zero sizes allowed); None
            learns them (one small metadata all-gather, ledger phase ``"metadata"``).
        channels_last: the channel dim is last instead of second.
        sum_param_grads: sum the weight / bias gradients over the group in backward (default).

    Returns:
        This rank's outputs, ``spatial_transpose_output_sizes(sizes, K[dim], stride, padding,
        output_padding, dilation)[rank]`` long along ``dim`` (rule in
        :mod:`shardkit.spatial.conv_transpose`); gathered, the unsharded ``torch`` output.

    Raises:
        ShardkitError: wrong dims, channels or bias shape, ``dim`` not spatial, ``output_padding``
            too large, a non-positive output length, bad ``sizes`` (all from agreed metadata).
        ShardkitTypeError, GroupMembershipError, RankMismatchError: as :func:`shardkit.all_gather`.

    Tiles: with ``dim`` a sequence of sharded spatial dims, ``group`` holds one group per dim
    (e.g. ``(mesh["h"], mesh["w"])``) and ``sizes`` one entry (list or None) per dim; the halos
    are exchanged one dim after another (see :mod:`shardkit.spatial.conv_transpose_tiled`).

    Communication at ``R > 1``: forward one ``all_to_all_single`` (none when no rank needs a
    neighbour element); backward one ``all_to_all_single`` and one ``all_reduce``.
"""


def spatial_conv_transpose1d(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    dim: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    output_padding: int | Sequence[int] = 0,
    groups: int = 1,
    dilation: int | Sequence[int] = 1,
    *,
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
    sum_param_grads: bool = True,
) -> torch.Tensor:
    return _spatial_conv_transpose(
        1,
        "spatial_conv_transpose1d",
        x_local,
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
    )


def spatial_conv_transpose2d(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    dim: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    output_padding: int | Sequence[int] = 0,
    groups: int = 1,
    dilation: int | Sequence[int] = 1,
    *,
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
    sum_param_grads: bool = True,
) -> torch.Tensor:
    return _spatial_conv_transpose(
        2,
        "spatial_conv_transpose2d",
        x_local,
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
    )


def spatial_conv_transpose3d(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    dim: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    output_padding: int | Sequence[int] = 0,
    groups: int = 1,
    dilation: int | Sequence[int] = 1,
    *,
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
    sum_param_grads: bool = True,
) -> torch.Tensor:
    return _spatial_conv_transpose(
        3,
        "spatial_conv_transpose3d",
        x_local,
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
    )


for _fn in (spatial_conv_transpose1d, spatial_conv_transpose2d, spatial_conv_transpose3d):
    _fn.__doc__ = _DOC
