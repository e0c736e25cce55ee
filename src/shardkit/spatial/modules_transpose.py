"""Layers: ``nn.ConvTranspose*d`` subclasses whose input and output are sharded along one spatial dim.

Same parameters, state-dict keys and initialization as ``nn.ConvTranspose*d`` (replicated on
every rank); :meth:`SpatialConvTranspose2d.from_module` wraps an existing layer, sharing its
parameters. See :mod:`shardkit.spatial.conv_transpose` for the output rule.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ShardkitError, ShardkitTypeError
from ._dtensor import conv_dtensor
from ._meta import inferred_sizes
from .conv_transpose import spatial_conv_transpose1d, spatial_conv_transpose2d, spatial_conv_transpose3d
from .modules import _SpatialConvMixin

__all__ = ["SpatialConvTranspose1d", "SpatialConvTranspose2d", "SpatialConvTranspose3d"]


class _SpatialConvTransposeMixin:
    _fn = None
    _base: type = nn.Module

    def __init__(
        self,
        in_channels,
        out_channels,
        kernel_size,
        stride=1,
        padding=0,
        output_padding=0,
        groups=1,
        bias=True,
        dilation=1,
        padding_mode="zeros",
        device=None,
        dtype=None,
        *,
        group,
        dim,
        channels_last=False,
    ):
        type(self)._base.__init__(
            self,
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            output_padding=output_padding,
            groups=groups,
            bias=bias,
            dilation=dilation,
            padding_mode=padding_mode,
            device=device,
            dtype=dtype,
        )
        _SpatialConvMixin._setup(self, group, dim, channels_last)  # the same group/dim checks

    def forward(self, x: torch.Tensor, sizes=None) -> torch.Tensor:
        """This rank's outputs; ``sizes``: every rank's input size along ``dim`` (None = equal,
        or all-gathered in forward when ``infer_sizes`` is set). No ``output_size=``."""
        if isinstance(x, DTensor):  # DTensor in, DTensor out: its split is the sizes (._dtensor)
            return conv_dtensor(self, x, sizes)
        name = type(self).__name__
        if sizes is None and self.infer_sizes:
            sizes = inferred_sizes(self, x, name)
        return type(self)._fn(
            x,
            self.weight,
            self.bias,
            self.group,
            self.dim,
            self.stride,
            self.padding,
            self.output_padding,
            self.groups,
            self.dilation,
            sizes=sizes,
            channels_last=self.channels_last,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dim={self.dim}, channels_last={self.channels_last}"

    @classmethod
    def from_module(cls, conv: nn.Module, group, dim: int, *, channels_last: bool = False):
        """A sharded layer sharing ``conv``'s parameters (no copy): gradients land on them."""
        if type(conv) is not cls._base:
            raise ShardkitTypeError(
                f"{cls.__name__}.from_module: expected an {cls._base.__name__}, got {type(conv).__name__}"
            )
        if conv.padding_mode != "zeros":
            raise ShardkitError(f"{cls.__name__}.from_module: only padding_mode='zeros', got {conv.padding_mode!r}")
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            output_padding=conv.output_padding,
            groups=conv.groups,
            bias=conv.bias is not None,
            dilation=conv.dilation,
            device="meta",
            dtype=conv.weight.dtype,
            group=group,
            dim=dim,
            channels_last=channels_last,
        )
        layer.weight = conv.weight
        if conv.bias is not None:
            layer.bias = conv.bias
        layer.train(conv.training)
        return layer


class SpatialConvTranspose1d(_SpatialConvTransposeMixin, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` sharded along L; see :func:`spatial_conv_transpose1d`.

    Extra keyword arguments: ``group``, ``dim`` (the sharded dim of the input), ``channels_last``.
    """

    _fn, _base = staticmethod(spatial_conv_transpose1d), nn.ConvTranspose1d


class SpatialConvTranspose2d(_SpatialConvTransposeMixin, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` sharded along H or W; see :func:`spatial_conv_transpose2d`."""

    _fn, _base = staticmethod(spatial_conv_transpose2d), nn.ConvTranspose2d


class SpatialConvTranspose3d(_SpatialConvTransposeMixin, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` sharded along D, H or W; see :func:`spatial_conv_transpose3d`."""

    _fn, _base = staticmethod(spatial_conv_transpose3d), nn.ConvTranspose3d
