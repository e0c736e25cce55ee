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
import torch.nn.functional as F

from ..comm import _c10d
from ..comm._group import GroupInfo
from ..comm._validate import dim_of, enter, expected_size, local_sizes, maybe_agree
from ..errors import ShardkitError, ShardkitTypeError
from ._meta import channels_first
from ._plan import BORDER_MODES
from ._sizes import check_out_len, conv_out_len, conv_padding, geometry_args, input_ranges, output_bounds, per_dim
from ._overlap import interior_split, overlapped_conv
from .halo import exchange, plan_for

if TYPE_CHECKING:
    from collections.abc import Sequence
    from .._types import Group

__all__ = ["spatial_conv1d", "spatial_conv2d", "spatial_conv3d"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class _SumParamGrads(torch.autograd.Function):
    """Identity on replicated parameters in forward; all-reduce (sum) of their gradients in backward."""

    @staticmethod
    def forward(ctx, g, api, *params):
        ctx.g, ctx.api = g, api
        return params

    @staticmethod
    def backward(ctx, *grads):
        if len({gr.dtype for gr in grads}) == 1:  # one all-reduce for weight and bias together
            flat = _c10d.all_reduce(torch.cat([gr.reshape(-1) for gr in grads]), ctx.g, ctx.api, "backward")
            out, pos = [], 0
            for gr in grads:
                out.append(flat[pos : pos + gr.numel()].view(gr.shape))
                pos += gr.numel()
        else:
            out = [_c10d.all_reduce(gr, ctx.g, ctx.api, "backward") for gr in grads]
        return (None, None, *out)


class _EmptyOutput(torch.autograd.Function):
    """A zero-size output that keeps this rank's backward collectives in the graph.

    A rank with no outputs (possible with tiny or very uneven splits) must still join the
    backward exchange and all-reduce of the other ranks, so its empty output depends on the
    halo and the parameters like a real one; ``torch`` convolutions reject empty inputs.
    """

    @staticmethod
    def forward(ctx, shape, x, weight, bias):
        ctx.shapes = (x.shape, weight.shape, None if bias is None else bias.shape)
        return x.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        return (None, *(None if s is None else grad.new_zeros(s) for s in ctx.shapes))


def _check_weight(x: torch.Tensor, weight, bias, groups, nd: int, op: str) -> None:
    if not isinstance(weight, torch.Tensor) or (bias is not None and not isinstance(bias, torch.Tensor)):
        raise ShardkitTypeError(f"{op}: weight and bias must be tensors (bias may be None)")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ShardkitError(f"{op}: groups must be an int >= 1, got {groups!r}")
    if weight.dim() != nd + 2:
        raise ShardkitError(f"{op}: weight must be {nd + 2}-d [C_out, C_in / groups, *K], got shape {tuple(weight.shape)}")
    c_out, c_in = weight.shape[0], x.shape[1]
    if c_in != weight.shape[1] * groups or c_out % groups:
        raise ShardkitError(
            f"{op}: input has {c_in} channels but weight {tuple(weight.shape)} with groups={groups} expects "
            f"{weight.shape[1] * groups} (and C_out divisible by groups)"
        )
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise ShardkitError(f"{op}: bias must have shape ({c_out},), got {tuple(bias.shape)}")


def conv_geometry(x, weight, bias, groups, nd: int, stride, padding, dilation, padding_mode: str, op: str):
    """Validate a convolution's arguments; return ``(kernel, stride, dilation, pads)`` per dim.

    Shared by the one-dim (:func:`_spatial_conv`) and tiled (``conv_tiled``) paths.

    Raises:
        ShardkitError, ShardkitTypeError: bad weight, bias, groups, padding or padding mode.
    """
    _check_weight(x, weight, bias, groups, nd, op)
    kernel = tuple(weight.shape[2:])
    stride = per_dim(stride, nd, "stride", op, 1)
    dilation = per_dim(dilation, nd, "dilation", op, 1)
    pads = conv_padding(padding, kernel, stride, dilation, op)
    if padding_mode not in BORDER_MODES:
        raise ShardkitError(f"{op}: padding_mode must be one of {BORDER_MODES}, got {padding_mode!r}")
    return kernel, stride, dilation, pads


def _check_border(mode: str, size: int, pad: tuple[int, int], dim: int, op: str) -> None:
    """torch's limits for local (non-sharded) padding: reflect < size, circular <= size."""
    if mode == "reflect" and max(pad) >= size:
        raise ShardkitError(f"{op}: reflect padding {pad} must be < the size {size} of dim {dim}")
    if mode == "circular" and max(pad) > size:
        raise ShardkitError(f"{op}: circular padding {pad} must be <= the size {size} of dim {dim}")
    if mode == "replicate" and max(pad) > 0 and size == 0:
        raise ShardkitError(f"{op}: replicate padding of the empty dim {dim}")


def _pad_other(nd, x, j, pads, mode):
    """Padding of every spatial dim but the sharded one ``j``: ``(x, conv_pad)``, either left to
    the convolution (symmetric zeros) or applied with ``F.pad`` (``conv_pad`` then all 0)."""
    other = [(0, 0) if i == j else p for i, p in enumerate(pads)]
    if mode == "zeros" and all(lo == hi for lo, hi in other):
        return x, [lo for lo, _ in other]
    flat = [v for p in reversed(other) for v in p]  # F.pad lists the last dim first
    if any(flat):  # an empty block has no border to reflect, replicate or wrap: constant keeps its shape
        constant = mode == "zeros" or x.shape[2 + j] == 0
        x = F.pad(x, flat, mode="constant" if constant else mode)
    return x, [0] * nd


def _local_conv(nd, x_seg, weight, bias, j, stride, dilation, groups, pads, mode):
    """The local convolution: no padding on the sharded spatial dim ``j``, ``pads`` elsewhere."""
    x_seg, conv_pad = _pad_other(nd, x_seg, j, pads, mode)
    return _CONV[nd](x_seg, weight, bias, stride, conv_pad, dilation, groups)


def _spatial_conv(nd, op, x, weight, bias, group, dim, stride, padding, dilation, groups, padding_mode, sizes,
                  channels_last, sum_param_grads, overlap=True):
    if isinstance(dim, (tuple, list)):  # several sharded dims (tiles on a mesh)
        from .conv_tiled import tiled_conv

        return tiled_conv(nd, op, x, weight, bias, group, dim, stride, padding, dilation, groups, padding_mode, sizes,
                          channels_last, sum_param_grads)
    g: GroupInfo = enter(x, group, op)
    known = maybe_agree(g, op, x, (dim, int(bool(channels_last)), int(x.requires_grad), sizes,
                                   *geometry_args(weight, bias, stride, padding, dilation, groups, padding_mode)),
                        local_dim=dim, expected_local=expected_size(sizes, g.rank))
    if x.dim() != nd + 2:
        layout = "[B, *S, C]" if channels_last else "[B, C, *S]"
        raise ShardkitError(f"{op}: expected a {nd + 2}-d input {layout}, got shape {tuple(x.shape)}")
    d = dim_of(x, dim, op)
    xc, dc = channels_first(x, d, nd, channels_last, dim, op)
    j = dc - 2
    kernel, stride, dilation, pads = conv_geometry(xc, weight, bias, groups, nd, stride, padding, dilation, padding_mode, op)
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
        split = interior_split(lo, hi, plan.offsets[g.rank], sizes[g.rank], kernel[j], stride[j], dilation[j], pads[j][0])
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
        out_lens = [0 if i == j else conv_out_len(lens[i], kernel[i], stride[i], dilation[i], pads[i]) for i in range(nd)]
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
        stride, dilation: an int or one per spatial dim (>= 1).
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


def spatial_conv1d(x_local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                   dim: int | Sequence[int], stride: int | Sequence[int] = 1, padding: int | Sequence[int] | str = 0,
                   dilation: int | Sequence[int] = 1, groups: int = 1, *, padding_mode: str = "zeros",
                   sizes: Sequence[int] | None = None, channels_last: bool = False, sum_param_grads: bool = True,
                   overlap: bool = True) -> torch.Tensor:
    return _spatial_conv(1, "spatial_conv1d", x_local, weight, bias, group, dim, stride, padding, dilation, groups,
                         padding_mode, sizes, channels_last, sum_param_grads, overlap)


def spatial_conv2d(x_local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                   dim: int | Sequence[int], stride: int | Sequence[int] = 1, padding: int | Sequence[int] | str = 0,
                   dilation: int | Sequence[int] = 1, groups: int = 1, *, padding_mode: str = "zeros",
                   sizes: Sequence[int] | None = None, channels_last: bool = False, sum_param_grads: bool = True,
                   overlap: bool = True) -> torch.Tensor:
    return _spatial_conv(2, "spatial_conv2d", x_local, weight, bias, group, dim, stride, padding, dilation, groups,
                         padding_mode, sizes, channels_last, sum_param_grads, overlap)


def spatial_conv3d(x_local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                   dim: int | Sequence[int], stride: int | Sequence[int] = 1, padding: int | Sequence[int] | str = 0,
                   dilation: int | Sequence[int] = 1, groups: int = 1, *, padding_mode: str = "zeros",
                   sizes: Sequence[int] | None = None, channels_last: bool = False, sum_param_grads: bool = True,
                   overlap: bool = True) -> torch.Tensor:
    return _spatial_conv(3, "spatial_conv3d", x_local, weight, bias, group, dim, stride, padding, dilation, groups,
                         padding_mode, sizes, channels_last, sum_param_grads, overlap)


for _fn in (spatial_conv1d, spatial_conv2d, spatial_conv3d):
    _fn.__doc__ = _DOC
