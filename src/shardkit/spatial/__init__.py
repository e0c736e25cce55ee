"""Spatial (halo-exchange) parallelism: tensors and convolutions sharded along a spatial dim.

:func:`halo_exchange` is the differentiable primitive; :func:`spatial_conv1d` /
:func:`spatial_conv2d` / :func:`spatial_conv3d` and the layers :class:`SpatialConv1d` /
:class:`SpatialConv2d` / :class:`SpatialConv3d` / :class:`RingConv2d` build on it, and the transposed
:func:`spatial_conv_transpose2d` (1-d / 3-d) / :class:`SpatialConvTranspose2d` (1-d / 3-d);
:func:`spatial_output_sizes` is the pure rule that says which outputs each rank computes.
Layers needing global statistics or neighbours: :class:`SpatialGroupNorm`,
:class:`SpatialBatchNorm2d`, :class:`SpatialUpsample` / :func:`spatial_interpolate`, pooling
(:func:`spatial_max_pool`, :func:`spatial_avg_pool`); :func:`apply_spatial` converts a plain
model's layers in place.
"""

from ._sizes import spatial_output_sizes
from .apply import apply_spatial
from .conv import spatial_conv1d, spatial_conv2d, spatial_conv3d
from .conv_transpose import (
    spatial_conv_transpose1d,
    spatial_conv_transpose2d,
    spatial_conv_transpose3d,
    spatial_transpose_output_sizes,
)
from .halo import halo_exchange
from .modules import RingConv2d, SpatialConv1d, SpatialConv2d, SpatialConv3d, ring_conv2d
from .modules_transpose import SpatialConvTranspose1d, SpatialConvTranspose2d, SpatialConvTranspose3d
from .norm import SpatialBatchNorm2d, SpatialGroupNorm, spatial_group_norm
from .pool import SpatialAvgPool2d, SpatialMaxPool2d, spatial_avg_pool, spatial_max_pool
from .resample import SpatialUpsample, spatial_interpolate

__all__ = [
    "halo_exchange",
    "spatial_conv1d",
    "spatial_conv2d",
    "spatial_conv3d",
    "spatial_output_sizes",
    "spatial_conv_transpose1d",
    "spatial_conv_transpose2d",
    "spatial_conv_transpose3d",
    "spatial_transpose_output_sizes",
    "SpatialConvTranspose1d",
    "SpatialConvTranspose2d",
    "SpatialConvTranspose3d",
    "SpatialConv1d",
    "SpatialConv2d",
    "SpatialConv3d",
    "RingConv2d",
    "ring_conv2d",
    "spatial_group_norm",
    "SpatialGroupNorm",
    "SpatialBatchNorm2d",
    "spatial_interpolate",
    "SpatialUpsample",
    "spatial_max_pool",
    "spatial_avg_pool",
    "SpatialMaxPool2d",
    "SpatialAvgPool2d",
    "apply_spatial",
]
