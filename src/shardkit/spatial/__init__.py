"""Spatial (halo-exchange) parallelism: tensors and convolutions sharded along a spatial dim.

:func:`halo_exchange` is the differentiable primitive; :func:`spatial_conv1d` /
:func:`spatial_conv2d` / :func:`spatial_conv3d` and the layers :class:`SpatialConv1d` /
:class:`SpatialConv2d` / :class:`SpatialConv3d` / :class:`RingConv2d` build on it;
:func:`spatial_output_sizes` is the pure rule that says which outputs each rank computes.
"""

from ._sizes import spatial_output_sizes
from .conv import spatial_conv1d, spatial_conv2d, spatial_conv3d
from .halo import halo_exchange
from .modules import RingConv2d, SpatialConv1d, SpatialConv2d, SpatialConv3d, ring_conv2d

__all__ = [
    "halo_exchange",
    "spatial_conv1d",
    "spatial_conv2d",
    "spatial_conv3d",
    "spatial_output_sizes",
    "SpatialConv1d",
    "SpatialConv2d",
    "SpatialConv3d",
    "RingConv2d",
    "ring_conv2d",
]
