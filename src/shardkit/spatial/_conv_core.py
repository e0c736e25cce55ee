"""What every sharded convolution shares: argument checks and geometry, the local convolution
with its non-sharded padding, and the autograd pieces for replicated parameters and empty outputs.

Used by the one-dim path (:mod:`.conv`), the tiled path (:mod:`.conv_tiled`), the transposed
convolutions and the norms; they import it, and it imports none of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import _c10d
from ..errors import ShardkitError, ShardkitTypeError
from ._plan import BORDER_MODES
from ._sizes import conv_padding, per_dim

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
        raise ShardkitError(
            f"{op}: weight must be {nd + 2}-d [C_out, C_in / groups, *K], got shape {tuple(weight.shape)}"
        )
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

    Shared by the one-dim (:mod:`.conv`) and tiled (:mod:`.conv_tiled`) paths.

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
