"""Max and average pooling over an input sharded along one spatial dim.

Pooling windows are convolution windows: the same output rule (window centre,
:mod:`._sizes`), the same input ranges and the same one-``all_to_all_single`` halo plan as
:mod:`.conv`. Only the border differs: max pooling pads with ``-inf`` (so the halo request is
clipped to the frame and ``-inf`` is added locally at the global borders), average pooling pads
with zeros, and ``count_include_pad=False`` divides by a window count of real elements.
Windows are summed with ``divisor_override=1`` and divided here, so the divisor is exactly
torch's.

Collectives per call at ``R > 1``: forward one ``all_to_all_single`` (none when no rank needs
a neighbour element); backward one when the input needs a gradient. No parameters.

Source: spatial parallelism for CNNs (Dryden et al., IPDPS 2019), as :mod:`.conv`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..comm._group import resolve_group
from ..comm._validate import dim_of, enter, expected_size, local_sizes, maybe_agree
from ..errors import ShardkitError, ShardkitTypeError
from ._meta import channels_first, inferred_sizes, keep_graph_empty
from ._sizes import check_out_len, conv_out_len, input_ranges, output_bounds, per_dim
from .halo import exchange, plan_for

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["spatial_max_pool", "spatial_avg_pool", "SpatialMaxPool2d", "SpatialAvgPool2d"]

_MAX = {2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {2: F.avg_pool2d, 3: F.avg_pool3d}


def _shape_with(x, d, n):
    s = list(x.shape)
    s[d] = n
    return s


def _pool(
    kind,
    op,
    x,
    group,
    dim,
    kernel_size,
    stride,
    padding,
    dilation,
    count_include_pad,
    divisor_override,
    ceil_mode,
    sizes,
    channels_last,
):
    g = enter(x, group, op)
    # every window argument sets the halo widths and the output split: agreed, like the sizes
    maybe_agree(
        g,
        op,
        x,
        (
            dim,
            int(bool(channels_last)),
            int(x.requires_grad),
            sizes,
            kernel_size,
            stride,
            padding,
            dilation,
            int(bool(ceil_mode)),
            int(bool(count_include_pad)),
            divisor_override,
        ),
        local_dim=dim,
        expected_local=expected_size(sizes, g.rank),
    )
    nd = x.dim() - 2
    if nd not in (1, 2, 3):
        raise ShardkitError(f"{op}: expected a 3-d to 5-d input [B, C, *S], got shape {tuple(x.shape)}")
    if ceil_mode:
        raise ShardkitError(f"{op}: ceil_mode=True is not supported (its last window depends on the global size)")
    d = dim_of(x, dim, op)
    xc, dc = channels_first(x, d, nd, channels_last, dim, op)
    if nd == 1:  # torch's 1-d average pooling has no divisor_override: pool 2-d with a unit dim
        xc = xc.unsqueeze(-1)
    k = per_dim(kernel_size, nd, "kernel_size", op, 1)
    s = k if stride is None or stride == [] or stride == () else per_dim(stride, nd, "stride", op, 1)
    p = per_dim(padding, nd, "padding", op, 0)
    dl = per_dim(dilation, nd, "dilation", op, 1)
    if any(pi > ki // 2 for pi, ki in zip(p, k)):
        raise ShardkitError(f"{op}: padding {p} must be at most half the kernel {k} (as torch)")
    if nd == 1:
        k, s, p, dl = k + (1,), s + (1,), p + (0,), dl + (1,)
    j = dc - 2
    sizes = local_sizes(xc, g, dc, sizes, op)
    N = sum(sizes)
    lens = [N if i == j else xc.shape[2 + i] for i in range(len(k))]
    for i in range(len(k)):
        check_out_len(lens[i], k[i], s[i], dl[i], (p[i], p[i]), op, g.size)
    geometry = (k[j], s[j], dl[j], (p[j], p[j]))
    ranges = input_ranges(sizes, *geometry)
    a, b = ranges[g.rank]
    local_pad = tuple(0 if i == j else p[i] for i in range(len(k)))
    bounds = output_bounds(sizes, *geometry)
    n_out = bounds[g.rank + 1] - bounds[g.rank]
    if kind == "max":
        clipped = tuple((max(lo, 0), min(hi, N)) if hi > lo else (0, 0) for lo, hi in ranges)
        seg = exchange(xc, g, dc, plan_for(op, sizes, clipped, "zeros"), op)
        left, right = (max(0, -a), max(0, b - N)) if b > a else (0, 0)
        if left or right:
            parts = [
                seg.new_full(_shape_with(seg, dc, left), -math.inf),
                seg,
                seg.new_full(_shape_with(seg, dc, right), -math.inf),
            ]
            seg = torch.cat(parts, dc)
    else:
        seg = exchange(xc, g, dc, plan_for(op, sizes, ranges, "zeros"), op)
    if n_out == 0:
        out_lens = [0 if i == j else conv_out_len(lens[i], k[i], s[i], dl[i], (p[i], p[i])) for i in range(len(k))]
        out = keep_graph_empty([xc.shape[0], xc.shape[1], *out_lens], seg)
    elif kind == "max":
        out = _MAX[len(k)](seg, k, s, local_pad, dl)
    else:
        total = _AVG[len(k)](seg, k, s, local_pad, False, True, 1)  # window sums
        if divisor_override:
            out = total / divisor_override
        elif count_include_pad:
            out = total / math.prod(k)
        else:  # count real elements: a mask that is 0 on the global padding along dim
            n_seg = seg.shape[dc]
            pos = torch.arange(a, a + n_seg, device=seg.device)
            mask_1d = ((pos >= 0) & (pos < N)).to(seg.dtype)
            shape = [1] * seg.dim()
            shape[dc] = n_seg
            mask = mask_1d.view(shape).expand([1, 1, *seg.shape[2:]])
            out = total / _AVG[len(k)](mask, k, s, local_pad, False, True, 1)
    if nd == 1:
        out = out.squeeze(-1)
    return out.movedim(1, -1) if channels_last else out


_ARGS = """
    Args:
        x_local: ``[B, C, *S_local]`` (``[B, *S_local, C]`` with ``channels_last``), 1 to 3
            spatial dims, sharded along ``dim``.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sharded spatial dim (negative allowed).
        kernel_size: as torch.
        stride: as torch (None = kernel_size).
        padding: as torch; at most half the kernel.
        sizes: every rank's size along ``dim`` (uneven and zero allowed); None = equal sizes.

    Returns:
        This rank's outputs, sharded as :func:`shardkit.spatial.spatial_output_sizes`
        (``sizes, kernel, stride, padding, dilation``) says.

    Raises:
        ShardkitError: ``ceil_mode=True``, ``dim`` not spatial, padding over half the kernel,
            a kernel larger than the padded input, bad ``sizes``.
"""


def spatial_max_pool(
    x_local: torch.Tensor,
    group: Group,
    dim: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    *,
    ceil_mode: bool = False,
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
) -> torch.Tensor:
    """Max pooling of an input sharded along ``dim``: halo exchange forward, its adjoint backward."""
    return _pool(
        "max",
        "spatial_max_pool",
        x_local,
        group,
        dim,
        kernel_size,
        stride,
        padding,
        dilation,
        True,
        None,
        ceil_mode,
        sizes,
        channels_last,
    )


def spatial_avg_pool(
    x_local: torch.Tensor,
    group: Group,
    dim: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    *,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
) -> torch.Tensor:
    """Average pooling of an input sharded along ``dim``: halo exchange forward, its adjoint backward."""
    return _pool(
        "avg",
        "spatial_avg_pool",
        x_local,
        group,
        dim,
        kernel_size,
        stride,
        padding,
        1,
        count_include_pad,
        divisor_override,
        ceil_mode,
        sizes,
        channels_last,
    )


spatial_max_pool.__doc__ = (spatial_max_pool.__doc__ or "") + _ARGS
spatial_avg_pool.__doc__ = (spatial_avg_pool.__doc__ or "") + _ARGS


def _ints(v: int | Sequence[int]) -> int | tuple[int, ...]:
    """An int, or the sequence as the tuple torch's pooling layers take."""
    return v if isinstance(v, int) else tuple(v)


def _pair(v: int | Sequence[int]) -> int | tuple[int, int]:
    """An int, or the ``(h, w)`` pair ``nn.AvgPool2d`` takes (a 1-sequence is an int, as in torch)."""
    if isinstance(v, int):
        return v
    values = tuple(v)
    if len(values) == 1:
        return values[0]
    h, w = values
    return h, w


class _PoolMixin(nn.Module):
    def _setup(self, group, dim, channels_last, infer_sizes):
        name = type(self).__name__
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ShardkitTypeError(f"{name}: dim must be an int, got {dim!r}")
        if self.ceil_mode:
            raise ShardkitError(f"{name}: ceil_mode=True is not supported")
        resolve_group(group, name)
        self.group, self.dim, self.channels_last, self.infer_sizes = group, dim, bool(channels_last), bool(infer_sizes)

    def _sizes(self, x, sizes):
        if sizes is None and self.infer_sizes:
            sizes = inferred_sizes(self, x, type(self).__name__)
        return sizes

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dim={self.dim}, channels_last={self.channels_last}"


class SpatialMaxPool2d(_PoolMixin, nn.MaxPool2d):
    """``nn.MaxPool2d`` over an input sharded along H or W (see :func:`spatial_max_pool`).

    Extra keyword arguments: ``group``, ``dim``, ``channels_last`` and ``infer_sizes`` (all-gather
    the split sizes in forward when none are passed; set by :func:`apply_spatial`).
    """

    def __init__(
        self,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
        *,
        group: Group,
        dim: int,
        channels_last: bool = False,
        infer_sizes: bool = False,
    ):
        if return_indices:
            raise ShardkitError("SpatialMaxPool2d: return_indices=True is not supported")
        super().__init__(
            _ints(kernel_size),
            None if stride is None else _ints(stride),
            _ints(padding),
            _ints(dilation),
            return_indices,
            ceil_mode,
        )
        self._setup(group, dim, channels_last, infer_sizes)

    def forward(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
        return spatial_max_pool(
            x,
            self.group,
            self.dim,
            self.kernel_size,
            self.stride,
            self.padding,
            self.dilation,
            sizes=self._sizes(x, sizes),
            channels_last=self.channels_last,
        )

    @classmethod
    def from_module(
        cls, m: nn.MaxPool2d, group: Group, dim: int, *, channels_last: bool = False, infer_sizes: bool = False
    ) -> SpatialMaxPool2d:
        return cls(
            m.kernel_size,
            m.stride,
            m.padding,
            m.dilation,
            m.return_indices,
            m.ceil_mode,
            group=group,
            dim=dim,
            channels_last=channels_last,
            infer_sizes=infer_sizes,
        )


class SpatialAvgPool2d(_PoolMixin, nn.AvgPool2d):
    """``nn.AvgPool2d`` over an input sharded along H or W (see :func:`spatial_avg_pool`)."""

    def __init__(
        self,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
        *,
        group: Group,
        dim: int,
        channels_last: bool = False,
        infer_sizes: bool = False,
    ):
        super().__init__(
            _pair(kernel_size),
            None if stride is None else _pair(stride),
            _pair(padding),
            ceil_mode,
            count_include_pad,
            divisor_override,
        )
        self._setup(group, dim, channels_last, infer_sizes)

    def forward(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
        return spatial_avg_pool(
            x,
            self.group,
            self.dim,
            self.kernel_size,
            self.stride,
            self.padding,
            count_include_pad=self.count_include_pad,
            divisor_override=self.divisor_override,
            sizes=self._sizes(x, sizes),
            channels_last=self.channels_last,
        )

    @classmethod
    def from_module(
        cls, m: nn.AvgPool2d, group: Group, dim: int, *, channels_last: bool = False, infer_sizes: bool = False
    ) -> SpatialAvgPool2d:
        return cls(
            m.kernel_size,
            m.stride,
            m.padding,
            m.ceil_mode,
            m.count_include_pad,
            m.divisor_override,
            group=group,
            dim=dim,
            channels_last=channels_last,
            infer_sizes=infer_sizes,
        )
