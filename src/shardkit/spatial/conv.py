"""Convolutions over an input sharded along one spatial dim (spatial / domain parallelism).

Each rank computes its own outputs (window-centre rule, :mod:`._sizes`) from the global input
range they read: one halo exchange fetches the missing neighbour elements and applies the
global border padding on the sharded dim (zeros, reflect, replicate, circular = periodic halo);
the other dims are padded locally; then a plain ``torch`` convolution runs with no padding on
the sharded dim. The weight and bias are replicated, so their gradients are summed over the
group in backward (one fused all-reduce).

By default (``overlap=True``) the exchange is posted asynchronously and the interior outputs,
whose windows lie in the local shard, are computed while it is in flight; the backward mirrors
it (:mod:`._overlap`). The collectives are the same either way.

Collectives per call at ``R > 1``: forward one ``all_to_all_single`` (none when no rank needs
a neighbour element); backward one ``all_to_all_single`` when the input needs a gradient and
one ``all_reduce`` of the flattened weight and bias gradients.

Source: spatial parallelism for CNNs (Dryden et al., IPDPS 2019; the halo-exchange
``RingConv2d`` of PaddlePaddle, generalized to any kernel, stride, dilation, padding and split).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm._group import GroupInfo
from ..comm._validate import dim_of, enter, expected_size, local_sizes, maybe_agree
from ..errors import ShardkitError
from ._conv_core import (
    _check_border,
    _EmptyOutput,
    _local_conv,
    _pad_other,
    _SumParamGrads,
    conv_geometry,
)
from ._meta import channels_first
from ._overlap import interior_split, overlapped_conv
from ._sizes import (
    check_out_len,
    conv_out_len,
    geometry_args,
    input_ranges,
    output_bounds,
)
from .conv_tiled import tiled_conv
from .halo import exchange, plan_for

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["spatial_conv1d", "spatial_conv2d", "spatial_conv3d"]


def _spatial_conv(
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
    overlap=True,
):
    if isinstance(dim, (tuple, list)):  # several sharded dims (tiles on a mesh)
        return tiled_conv(
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
        )
    g: GroupInfo = enter(x, group, op)
    known = maybe_agree(
        g,
        op,
        x,
        (
            dim,
            int(bool(channels_last)),
            int(x.requires_grad),
            sizes,
            *geometry_args(weight, bias, stride, padding, dilation, groups, padding_mode),
        ),
        local_dim=dim,
        expected_local=expected_size(sizes, g.rank),
    )
    if x.dim() != nd + 2:
        layout = "[B, *S, C]" if channels_last else "[B, C, *S]"
        raise ShardkitError(f"{op}: expected a {nd + 2}-d input {layout}, got shape {tuple(x.shape)}")
    d = dim_of(x, dim, op)
    xc, dc = channels_first(x, d, nd, channels_last, dim, op)
    j = dc - 2
    kernel, stride, dilation, pads = conv_geometry(
        xc, weight, bias, groups, nd, stride, padding, dilation, padding_mode, op
    )
    sizes = local_sizes(xc, g, dc, sizes, op, known)
    lens = [sum(sizes) if i == j else xc.shape[2 + i] for i in range(nd)]
    for i in range(nd):
        check_out_len(lens[i], kernel[i], stride[i], dilation[i], pads[i], op, g.size)
        if i != j:
            _check_border(padding_mode, lens[i], pads[i], 2 + i - int(channels_last), op)
    geometry = (kernel[j], stride[j], dilation[j], pads[j])
    plan = plan_for(op, sizes, input_ranges(sizes, *geometry), padding_mode)
    bounds = output_bounds(sizes, *geometry)
    lo, hi = bounds[g.rank], bounds[g.rank + 1]
    split = None
    if overlap and plan.traffic and hi > lo:  # without traffic there is nothing to overlap
        split = interior_split(
            lo, hi, plan.offsets[g.rank], sizes[g.rank], kernel[j], stride[j], dilation[j], pads[j][0]
        )
    params = [p for p in (weight, bias) if p is not None]
    if sum_param_grads and g.size > 1 and torch.is_grad_enabled() and any(p.requires_grad for p in params):
        params = _SumParamGrads.apply(g, op, *params)
        weight, bias = params[0], (params[1] if bias is not None else None)
    local_pads, local_mode = pads, padding_mode
    if overlap and plan.traffic:
        # The other dims' padding commutes with the exchange along dim (it pads each position of
        # dim on its own), so the overlapped path pads the local block first. Every rank does,
        # with or without interior outputs: the exchanged blocks must have one shape.
        xc, conv_pad = _pad_other(nd, xc, j, pads, padding_mode)
        local_pads, local_mode = [(p, p) for p in conv_pad], "zeros"
        if split is not None:
            out = overlapped_conv(nd, xc, weight, bias, g, dc, plan, split, stride, conv_pad, dilation, groups, op)
            return out.movedim(1, -1) if channels_last else out
    x_seg = exchange(xc, g, dc, plan, op)
    if hi == lo:
        out_lens = [
            0 if i == j else conv_out_len(lens[i], kernel[i], stride[i], dilation[i], pads[i]) for i in range(nd)
        ]
        out = _EmptyOutput.apply([xc.shape[0], weight.shape[0], *out_lens], x_seg, weight, bias)
    else:
        out = _local_conv(nd, x_seg, weight, bias, j, stride, dilation, groups, local_pads, local_mode)
    return out.movedim(1, -1) if channels_last else out


_DOC = """Convolution of an input sharded along spatial dim ``dim``; output sharded along the same dim.

    Forward: halo exchange of the input elements this rank's outputs read, then a local
    convolution; backward: the reverse exchange adds halo gradients into their owners, and the
    weight / bias gradients are summed over the group (their adjoint, since they are replicated).

    Args:
        x_local: ``[B, C_in, *S_local]`` (``[B, *S_local, C_in]`` with ``channels_last``), where
            ``S_local`` is the global spatial shape with ``sizes[rank]`` at ``dim``.
        weight: ``[C_out, C_in / groups, *K]``, replicated on every rank.
        bias: ``[C_out]`` or None, replicated.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sharded spatial dim of ``x_local`` (negative allowed), e.g. ``-1`` for W of
            NCHW, ``2`` for W of NHWC.
        stride: an int or one per spatial dim (>= 1).
        dilation: an int or one per spatial dim (>= 1).
        padding: an int or one per spatial dim (both sides), ``"valid"`` or ``"same"``
            (stride 1 only, as torch).
        groups: as torch (``groups == C_in`` is depthwise).
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"`` (as
            ``torch.nn.Conv*d``); on the sharded dim it applies at the *global* borders only.
        sizes: every rank's input size along ``dim`` (uneven and zero sizes allowed); None
            learns them (one small metadata all-gather, ledger phase ``"metadata"``).
        channels_last: the channel dim is last instead of second.
        sum_param_grads: sum the weight / bias gradients over the group in backward (default).
            Pass False when the caller sums them itself once per step (e.g. a gradient hook).
        overlap: compute the interior outputs (windows inside the local shard) while the halo
            exchange is in flight, and the interior input gradient while the halo gradients
            travel back (default; :mod:`shardkit.spatial._overlap`). False: exchange, then
            convolve. Same collectives and results either way (up to summation order).

    Tiles: with ``dim`` a sequence of sharded spatial dims, ``group`` holds one group per dim
    (e.g. ``(mesh["h"], mesh["w"])`` of a 2-D mesh) and ``sizes`` one entry (list or None) per
    dim; the halo is exchanged one dim after another, the later exchanges carrying the corners,
    and the parameter gradients are summed over each group (see
    :mod:`shardkit.spatial.conv_tiled`); tiles are not overlapped (``overlap`` is ignored).

    Returns:
        This rank's outputs ``[B, C_out, *S_out_local]`` (channels last if the input is), with
        ``spatial_output_sizes(sizes, K[dim], stride, padding, dilation)[rank]`` at ``dim``: the
        outputs whose window centre lies in this rank's input shard (see
        :func:`shardkit.spatial.spatial_output_sizes`). Gathering them gives the output of the
        unsharded ``torch`` convolution.

    Raises:
        ShardkitError: wrong dims, channels or bias shape, ``dim`` not spatial, ``"same"`` with
            a stride, unknown ``padding_mode``, a kernel larger than the padded input, reflect
            padding not smaller than the global size, bad ``sizes``. All are checked from
            arguments every rank agrees on, before any communication.
        ShardkitTypeError, GroupMembershipError, RankMismatchError: as :func:`shardkit.all_gather`.

    Every rank must run the backward of every sharded convolution it ran (they communicate).
"""


def spatial_conv1d(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    dim: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    *,
    padding_mode: str = "zeros",
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
    sum_param_grads: bool = True,
    overlap: bool = True,
) -> torch.Tensor:
    return _spatial_conv(
        1,
        "spatial_conv1d",
        x_local,
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
        overlap,
    )


def spatial_conv2d(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    dim: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    *,
    padding_mode: str = "zeros",
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
    sum_param_grads: bool = True,
    overlap: bool = True,
) -> torch.Tensor:
    return _spatial_conv(
        2,
        "spatial_conv2d",
        x_local,
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
        overlap,
    )


def spatial_conv3d(
    x_local: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    dim: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    *,
    padding_mode: str = "zeros",
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
    sum_param_grads: bool = True,
    overlap: bool = True,
) -> torch.Tensor:
    return _spatial_conv(
        3,
        "spatial_conv3d",
        x_local,
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
        overlap,
    )


for _fn in (spatial_conv1d, spatial_conv2d, spatial_conv3d):
    _fn.__doc__ = _DOC
