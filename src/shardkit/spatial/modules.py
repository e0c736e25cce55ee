"""Layers: ``nn.Conv*d`` subclasses whose input and output are sharded along one spatial dim.

They keep ``nn.Conv*d``'s parameters, state-dict keys and initialization (a full, replicated
weight on every rank), so a checkpoint of the unsharded model loads as is, and
:meth:`SpatialConv2d.from_conv` wraps an existing layer sharing its parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm._group import resolve_group
from ..errors import ShardkitError, ShardkitTypeError
from ._dtensor import conv_dtensor
from ._meta import inferred_sizes
from .conv import spatial_conv1d, spatial_conv2d, spatial_conv3d

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["SpatialConv1d", "SpatialConv2d", "SpatialConv3d", "RingConv2d", "ring_conv2d"]


class _SpatialConvMixin:
    _fn = None
    _base: type = nn.Module

    def _setup(self, group, dim, channels_last: bool) -> None:
        name = type(self).__name__
        if isinstance(dim, (tuple, list)) and isinstance(group, (tuple, list)) and len(dim) == len(group) > 0:
            dims, grps = tuple(dim), tuple(group)  # tiles: one group per sharded dim
        else:
            dims, grps = (dim,), (group,)
        for d, g in zip(dims, grps):
            if isinstance(d, bool) or not isinstance(d, int):
                raise ShardkitTypeError(
                    f"{name}: dim must be an int (or a sequence of ints with one group each), got {dim!r}"
                )
            resolve_group(g, name)  # fail at construction on a bad group, not in the first forward
        if len(dims) > 1:
            dim, group = dims, grps
        self.group, self.dim, self.channels_last = group, dim, bool(channels_last)
        # Set by apply_spatial: model code passes no sizes=, so all-gather them (uneven splits).
        self.infer_sizes = False
        # Overlap the halo exchange with the interior outputs (spatial_conv2d's overlap=).
        self.overlap = True

    def forward(self, x: torch.Tensor, sizes=None) -> torch.Tensor:
        """This rank's outputs; ``sizes``: every rank's input size along ``dim`` (None = equal,
        or all-gathered in forward when ``infer_sizes`` is set)."""
        if isinstance(x, DTensor):  # DTensor in, DTensor out: its split is the sizes (._dtensor)
            return conv_dtensor(self, x, sizes)
        if sizes is None and self.infer_sizes:
            sizes = inferred_sizes(self, x, type(self).__name__)
        return type(self)._fn(
            x,
            self.weight,
            self.bias,
            self.group,
            self.dim,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            padding_mode=self.padding_mode,
            sizes=sizes,
            channels_last=self.channels_last,
            overlap=self.overlap,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dim={self.dim}, channels_last={self.channels_last}"

    @classmethod
    def from_conv(cls, conv: nn.Module, group, dim: int, *, channels_last: bool = False):
        """A sharded layer sharing ``conv``'s parameters (no copy): gradients land on them."""
        return cls._build(conv, group=group, dim=dim, channels_last=channels_last)

    @classmethod
    def _build(cls, conv: nn.Module, **extra):
        if type(conv) is not cls._base:
            raise ShardkitTypeError(
                f"{cls.__name__}.from_conv: expected an {cls._base.__name__}, got {type(conv).__name__}"
            )
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device="meta",
            dtype=conv.weight.dtype,
            **extra,
        )
        layer.weight = conv.weight
        if conv.bias is not None:
            layer.bias = conv.bias
        return layer


def _init(
    self,
    base,
    in_channels,
    out_channels,
    kernel_size,
    stride,
    padding,
    dilation,
    groups,
    bias,
    padding_mode,
    device,
    dtype,
    group,
    dim,
    channels_last,
):
    base.__init__(
        self,
        in_channels,
        out_channels,
        kernel_size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=bias,
        padding_mode=padding_mode,
        device=device,
        dtype=dtype,
    )
    self._setup(group, dim, channels_last)


class SpatialConv1d(_SpatialConvMixin, nn.Conv1d):
    """``nn.Conv1d`` over ``[B, C, L / R]`` (or ``[B, L / R, C]``) sharded along L; see :func:`spatial_conv1d`.

    Extra keyword arguments: ``group`` (a ``ProcessGroup`` or 1-D ``DeviceMesh``), ``dim`` (the
    sharded dim of the input) and ``channels_last``.
    """

    _fn, _base = staticmethod(spatial_conv1d), nn.Conv1d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | str = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        group: Group,
        dim: int | Sequence[int] = -1,
        channels_last: bool = False,
    ):
        _init(
            self,
            nn.Conv1d,
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            device,
            dtype,
            group,
            dim,
            channels_last,
        )


class SpatialConv2d(_SpatialConvMixin, nn.Conv2d):
    """``nn.Conv2d`` over an input sharded along H or W (``dim``); see :func:`spatial_conv2d`.

    Extra keyword arguments: ``group`` (a ``ProcessGroup`` or 1-D ``DeviceMesh``), ``dim`` (the
    sharded dim of the input: 2 = H or 3 = W for NCHW, 1 or 2 for NHWC) and ``channels_last``.
    """

    _fn, _base = staticmethod(spatial_conv2d), nn.Conv2d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | str = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        group: Group,
        dim: int | Sequence[int],
        channels_last: bool = False,
    ):
        _init(
            self,
            nn.Conv2d,
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            device,
            dtype,
            group,
            dim,
            channels_last,
        )


class SpatialConv3d(_SpatialConvMixin, nn.Conv3d):
    """``nn.Conv3d`` over an input sharded along D, H or W (``dim``); see :func:`spatial_conv3d`."""

    _fn, _base = staticmethod(spatial_conv3d), nn.Conv3d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | str = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        group: Group,
        dim: int | Sequence[int],
        channels_last: bool = False,
    ):
        _init(
            self,
            nn.Conv3d,
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            device,
            dtype,
            group,
            dim,
            channels_last,
        )


_FORMATS = {"NCHW": (-1, False), "NHWC": (2, True)}


def _format(data_format, op: str):
    if data_format not in _FORMATS:
        raise ShardkitError(f"{op}: data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
    return _FORMATS[data_format]


def ring_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    data_format: str = "NCHW",
    *,
    group: Group,
    sizes: Sequence[int] | None = None,
    padding_mode: str = "zeros",
) -> torch.Tensor:
    """2-D convolution of an input sharded along W (PaddlePaddle ``RingConv2d``'s interface).

    ``x`` is ``[B, C, H, W / R]`` (``"NCHW"``) or ``[B, H, W / R, C]`` (``"NHWC"``); the output
    is sharded along W the same way. Unlike the original (stride 1, dilation 1, kernel half-width
    within one shard, W divisible), any kernel, stride, dilation, padding and uneven split work:
    it is :func:`spatial_conv2d` with ``dim`` set to W.
    """
    dim, channels_last = _format(data_format, "ring_conv2d")
    return spatial_conv2d(
        x,
        weight,
        bias,
        group,
        dim,
        stride,
        padding,
        dilation,
        groups,
        padding_mode=padding_mode,
        sizes=sizes,
        channels_last=channels_last,
    )


class RingConv2d(SpatialConv2d):
    """``nn.Conv2d`` whose input and output are sharded along W; see :func:`ring_conv2d`.

    Extra keyword arguments: ``group`` and ``data_format`` (``"NCHW"`` or ``"NHWC"``).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | str = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        group: Group,
        data_format: str = "NCHW",
    ):
        dim, channels_last = _format(data_format, "RingConv2d")
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            device,
            dtype,
            group=group,
            dim=dim,
            channels_last=channels_last,
        )
        self.data_format = data_format

    @classmethod
    def from_conv(cls, conv: nn.Module, group: Group, *, data_format: str = "NCHW") -> RingConv2d:
        """A W-sharded layer sharing ``conv``'s parameters (no copy)."""
        return cls._build(conv, group=group, data_format=data_format)
