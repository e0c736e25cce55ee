"""Sharded convolution with the halo exchange overlapped with the interior computation.

Along the sharded dim a rank's outputs ``[lo, hi)`` split into the *interior* ``[i_lo, i_hi)``,
whose windows lie inside the rank's own shard, and the *border* outputs on either side, whose
windows reach into a halo (or the global padding). Forward:

1. pack and post the halo exchange (``all_to_all_single`` with ``async_op=True``);
2. convolve the interior from the local block (no copy: a view of it);
3. wait, build the two border slabs ``[halo | edge of local]`` (and ``[edge | halo]``) and
   convolve them; concatenate ``[left | interior | right]``.

Backward, the mirror image: the border slabs' input gradients are computed first and sent to
their owners asynchronously (the reverse exchange); the interior input gradient and the weight /
bias gradients (one call over the whole requested range, as the non-overlapped path) are
computed while the gradients travel; then wait and add the received halo gradients.

Same collectives (one ``all_to_all_single`` each way), same plan, same results up to the
floating-point order of a few additions. Used by :func:`shardkit.spatial.spatial_conv2d` (and
1-d / 3-d) with ``overlap=True`` (the default) whenever some rank exchanges halos and this
rank has interior outputs; otherwise the sequential path runs.

Source: the interior / boundary split that overlaps halo exchanges with computation in
domain-decomposed stencil codes, as used for spatially parallel CNNs (Dryden et al., IPDPS 2019).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..comm._group import GroupInfo
from ._plan import Plan
from .halo import Posted, post_backward, post_forward

__all__ = ["Split", "interior_split", "overlapped_conv"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class Split(NamedTuple):
    """Where the interior and the border slabs lie along the sharded dim.

    ``n_left`` / ``n_int`` / ``n_right``: output counts; ``int_start`` / ``int_len``: the
    interior's input range in the local block; ``left_len``: the left slab is request positions
    ``[0, left_len)``; ``right_lo``: the right slab is ``[right_lo, request length)``.
    """

    n_left: int
    n_int: int
    n_right: int
    int_start: int
    int_len: int
    left_len: int
    right_lo: int


def interior_split(lo: int, hi: int, off: int, n: int, k: int, s: int, d: int, pad_left: int) -> Split | None:
    """The interior of outputs ``[lo, hi)`` of a rank holding inputs ``[off, off + n)``; None when empty.

    Output ``o`` reads inputs ``o*s - pad_left + d*[0, k)``; it is interior when all of them
    are in ``[off, off + n)``.
    """
    reach = d * (k - 1)
    i_lo = max(lo, -((-(off + pad_left)) // s))  # ceil((off + p) / s)
    i_hi = min(hi, (off + n - 1 - reach + pad_left) // s + 1)
    if i_hi <= i_lo:
        return None
    return Split(
        i_lo - lo,
        i_hi - i_lo,
        hi - i_hi,
        i_lo * s - pad_left - off,
        (i_hi - 1 - i_lo) * s + reach + 1,
        (i_lo - 1 - lo) * s + reach + 1 if i_lo > lo else 0,
        (i_hi - lo) * s,
    )


class _Spec(NamedTuple):
    nd: int
    g: GroupInfo
    dim: int  # the sharded dim of the channels-first input
    plan: Plan
    split: Split
    stride: tuple
    conv_pad: list  # padding of every spatial dim (0 on the sharded one)
    dilation: tuple
    groups: int
    api: str


def _conv(spec: _Spec, x, weight, bias):
    return _CONV[spec.nd](x, weight, bias, spec.stride, spec.conv_pad, spec.dilation, spec.groups)


def _slabs(spec: _Spec, posted: Posted):
    """``(request start, slab, output start, output count)`` of the border slabs that exist."""
    sp, out = spec.split, []
    if sp.n_left:
        out.append((0, posted.assemble(0, sp.left_len), 0, sp.n_left))
    if sp.n_right:
        out.append((sp.right_lo, posted.assemble(sp.right_lo, posted.total), sp.n_left + sp.n_int, sp.n_right))
    return out


def _forward(spec: _Spec, x, weight, bias):
    sp = spec.split
    posted = post_forward(x, spec.g, spec.dim, spec.plan, spec.api, async_op=True)
    y_int = _conv(spec, x.narrow(spec.dim, sp.int_start, sp.int_len), weight, bias)  # while halos travel
    posted.wait()
    parts = [(o_lo, _conv(spec, slab, weight, bias)) for _, slab, o_lo, _ in _slabs(spec, posted)]
    parts = sorted(parts + [(sp.n_left, y_int)], key=lambda part: part[0])  # [left |] interior [| right]
    return torch.cat([y for _, y in parts], spec.dim), posted


def _conv_backward(spec: _Spec, gy, x, weight, has_bias: bool, mask):
    """``torch.ops.aten.convolution_backward``: ``(grad_input, grad_weight, grad_bias)`` as ``mask`` asks."""
    bias_sizes = [weight.shape[0]] if has_bias else None
    return torch.ops.aten.convolution_backward(
        gy,
        x,
        weight,
        bias_sizes,
        list(spec.stride),
        list(spec.conv_pad),
        list(spec.dilation),
        False,
        [0] * spec.nd,
        spec.groups,
        mask,
    )


class _OverlappedConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, x, weight, bias):
        y, posted = _forward(spec, x, weight, bias)
        ctx.spec, ctx.recv, ctx.has_bias = spec, posted.recv, bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, gy):
        spec, (x, weight), sp = ctx.spec, ctx.saved_tensors, ctx.spec.split
        need_x, need_w, need_b = ctx.needs_input_grad[1:4]
        need_b = need_b and ctx.has_bias
        posted = Posted(x, spec.g, spec.dim, spec.plan, ctx.recv)
        gx = gw = gb = None
        if need_x:
            # Border input gradients first: they are what the other ranks wait for.
            chunks = [
                (
                    req_lo,
                    _conv_backward(
                        spec, gy.narrow(spec.dim, o_lo, n_out), slab, weight, ctx.has_bias, [True, False, False]
                    )[0],
                )
                for req_lo, slab, o_lo, n_out in _slabs(spec, posted)
            ]
            gx = x.new_zeros(x.shape)
            pending = post_backward(chunks, gx, spec.g, spec.dim, spec.plan, spec.api, async_op=True)
            g_int = _conv_backward(
                spec,
                gy.narrow(spec.dim, sp.n_left, sp.n_int),
                x.narrow(spec.dim, sp.int_start, sp.int_len),
                weight,
                ctx.has_bias,
                [True, False, False],
            )[0]
            gx.narrow(spec.dim, sp.int_start, sp.int_len).add_(g_int)
        if need_w or need_b:
            # One call over the whole requested range, as the sequential path (same summation).
            _, gw, gb = _conv_backward(
                spec, gy, posted.assemble(0, posted.total), weight, ctx.has_bias, [False, need_w, need_b]
            )
        if need_x:
            pending.finish(gx)
        return None, gx, gw, gb


def overlapped_conv(
    nd: int,
    x: torch.Tensor,
    weight,
    bias,
    g: GroupInfo,
    dim: int,
    plan: Plan,
    split: Split,
    stride,
    conv_pad,
    dilation,
    groups: int,
    api: str,
) -> torch.Tensor:
    """This rank's outputs of a convolution of ``x`` ``[B, C, *S_local]`` sharded along ``dim``,
    the exchange of ``plan`` overlapped with the interior (see the module docstring).

    ``conv_pad``: the padding of the other spatial dims (0 on ``dim``), applied by the local
    convolutions; ``plan`` supplies the sharded dim's halos and global padding.
    """
    spec = _Spec(nd, g, dim, plan, split, tuple(stride), list(conv_pad), tuple(dilation), groups, api)
    tensors = [t for t in (x, weight, bias) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _OverlappedConv.apply(spec, x, weight, bias)
    return _forward(spec, x, weight, bias)[0]
