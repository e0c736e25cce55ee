"""``apply_spatial``: shard a plain convolutional model along one spatial dim, from the outside.

Converted in place (recursively, same attribute names, so parameter names and state-dict keys
do not change; parameters and buffers are shared, not copied):

* ``nn.Conv1d/2d/3d`` -> :class:`SpatialConv1d/2d/3d` (halo exchange);
* ``nn.ConvTranspose1d/2d/3d`` -> :class:`SpatialConvTranspose1d/2d/3d` (halo exchange; the
  forward's ``output_size=`` argument is not supported);
* ``nn.GroupNorm`` -> :class:`SpatialGroupNorm`, ``nn.BatchNorm2d`` -> :class:`SpatialBatchNorm2d`
  (statistics over the whole frame);
* ``nn.Upsample`` (integer scale) -> :class:`SpatialUpsample`;
* ``nn.MaxPool2d`` / ``nn.AvgPool2d`` -> :class:`SpatialMaxPool2d` / :class:`SpatialAvgPool2d`.

Parameters stay replicated; every converted layer sums its parameters' gradients over the
group exactly once in backward (convolutions and norms alike), so after ``backward`` each rank
holds the unsharded model's gradient. Converted layers all-gather the split sizes in forward
(one tiny collective per layer call) because model code passes no ``sizes=``; uneven splits
then just work.

Every other leaf module is kept and assumed to act element-wise or along the channel dim
(activations, dropout, identity, ...). Known layers that would silently give wrong results on
a sharded frame (``nn.Linear``, ``nn.Flatten``, adaptive pooling, ``LayerNorm``, padding
layers, ...) or unsupported settings (``ceil_mode``, ``size=`` upsampling,
non-integer scales) raise one :class:`ShardkitError` at apply time listing all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm._group import resolve_group
from ..comm.fingerprint import maybe_fingerprint
from ..errors import ShardkitError, ShardkitTypeError
from .modules import SpatialConv1d, SpatialConv2d, SpatialConv3d
from .modules_transpose import SpatialConvTranspose1d, SpatialConvTranspose2d, SpatialConvTranspose3d
from .norm import SpatialBatchNorm2d, SpatialGroupNorm
from .pool import SpatialAvgPool2d, SpatialMaxPool2d
from .resample import SpatialUpsample, check_interpolate_args

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["apply_spatial"]

_CONVS: dict[type[nn.Module], type[SpatialConv1d | SpatialConv2d | SpatialConv3d]] = {
    nn.Conv1d: SpatialConv1d,
    nn.Conv2d: SpatialConv2d,
    nn.Conv3d: SpatialConv3d,
}
_CONVTS: dict[type[nn.Module], type[SpatialConvTranspose1d | SpatialConvTranspose2d | SpatialConvTranspose3d]] = {
    nn.ConvTranspose1d: SpatialConvTranspose1d,
    nn.ConvTranspose2d: SpatialConvTranspose2d,
    nn.ConvTranspose3d: SpatialConvTranspose3d,
}

# Layers that mix positions along the sharded dim in ways no halo or statistic reduction here covers.
_UNSUPPORTED = (
    nn.Linear,
    nn.Bilinear,
    nn.Flatten,
    nn.Unflatten,
    nn.LayerNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.BatchNorm1d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LocalResponseNorm,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool3d,
    nn.MaxPool1d,
    nn.MaxPool3d,
    nn.LPPool1d,
    nn.LPPool2d,
    nn.Fold,
    nn.Unfold,
    nn.PixelUnshuffle,
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.RNNBase,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.UpsamplingNearest2d,
    nn.UpsamplingBilinear2d,
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
    nn.modules.padding._ConstantPadNd,
    nn.modules.padding._CircularPadNd,
    nn.ChannelShuffle,
)


def _problem(m: nn.Module, tiles: bool = False) -> str | None:
    """Why ``m`` cannot be converted (over several sharded dims with ``tiles``), or None."""
    if type(m) in _CONVS or type(m) is nn.GroupNorm:
        return None
    if tiles and type(m) in (nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d):
        return "not supported over tiles (several sharded dims) yet"
    if tiles and type(m) is nn.Upsample and m.mode not in ("nearest", "nearest-exact"):
        return f"mode={m.mode!r} is not supported over tiles (only nearest: it reads nothing outside the own tile)"
    if type(m) is nn.BatchNorm2d:
        return None
    if type(m) in _CONVTS:
        return None if m.padding_mode == "zeros" else f"padding_mode={m.padding_mode!r} (only 'zeros')"
    if type(m) is nn.Upsample:
        if m.size is not None or m.scale_factor is None:
            return "Upsample with size= (needs an integer scale_factor)"
        try:
            linear_dims = {"linear": 1, "bilinear": 2, "trilinear": 3}
            nd = len(m.scale_factor) if isinstance(m.scale_factor, tuple) else linear_dims.get(m.mode, 2)
            check_interpolate_args(m.scale_factor, m.mode, m.align_corners, nd, "apply_spatial")
        except ShardkitError as exc:
            return str(exc).removeprefix("apply_spatial: ")
        return None
    if type(m) in (nn.MaxPool2d, nn.AvgPool2d):
        if m.ceil_mode:
            return "ceil_mode=True"
        if getattr(m, "return_indices", False):
            return "return_indices=True"
        return None
    if isinstance(m, _UNSUPPORTED):
        return "mixes positions along the sharded dim (not supported on a sharded frame)"
    if any(True for _ in m.parameters(recurse=False)):
        return "has parameters of its own that would get only this rank's partial gradient"
    return None


def _convert(m: nn.Module, group, dim, channels_last: bool) -> nn.Module:
    if type(m) in _CONVS:
        layer = _CONVS[type(m)].from_conv(m, group, dim, channels_last=channels_last)
    elif type(m) in _CONVTS:
        layer = _CONVTS[type(m)].from_module(m, group, dim, channels_last=channels_last)
    elif type(m) is nn.GroupNorm:
        return SpatialGroupNorm.from_module(m, group)
    elif type(m) is nn.BatchNorm2d:
        layer = SpatialBatchNorm2d.from_module(m, group)
        layer.train(m.training)
        return layer
    elif type(m) is nn.Upsample:
        return SpatialUpsample.from_module(m, group, dim, channels_last=channels_last, infer_sizes=True)
    elif type(m) is nn.MaxPool2d:
        return SpatialMaxPool2d.from_module(m, group, dim, channels_last=channels_last, infer_sizes=True)
    elif type(m) is nn.AvgPool2d:
        return SpatialAvgPool2d.from_module(m, group, dim, channels_last=channels_last, infer_sizes=True)
    else:
        return m
    layer.infer_sizes = True
    layer.train(m.training)
    return layer


def _tile_groups(mesh_or_group, dims: tuple, op: str) -> tuple:
    """One 1-D group per sharded dim: the dims of a DeviceMesh with ``len(dims)`` dims, or a sequence."""
    if isinstance(mesh_or_group, DeviceMesh) and mesh_or_group.ndim == len(dims):
        names = mesh_or_group.mesh_dim_names
        if names is None:
            raise ShardkitError(f"{op}: a {mesh_or_group.ndim}-d DeviceMesh needs mesh_dim_names")
        return tuple(mesh_or_group[name] for name in names)
    if not isinstance(mesh_or_group, (tuple, list)) or len(mesh_or_group) != len(dims):
        raise ShardkitError(
            f"{op}: with {len(dims)} sharded dims {dims}, pass a {len(dims)}-d DeviceMesh or "
            f"{len(dims)} groups, got {mesh_or_group!r}"
        )
    return tuple(mesh_or_group)


def apply_spatial(
    module: nn.Module, mesh_or_group: Group | DeviceMesh, dim: int | Sequence[int], *, channels_last: bool = False
) -> nn.Module:
    """Shard ``module``'s (transposed) convolutions, norms, upsampling and pooling along spatial dim ``dim``, in place.

    After it, ``module(x_local)`` with ``x_local`` this rank's block of the input along ``dim``
    returns this rank's block of the unsharded output (window-centre split, see
    :func:`shardkit.spatial.spatial_output_sizes`), and backward leaves every parameter with the
    unsharded gradient, summed over the group exactly once.

    Args:
        module: a plain model (VAE-style encoder / decoder, U-Net, ...); modified in place.
        mesh_or_group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks; for tiles a 2-D
            (3-D) ``DeviceMesh`` whose dims shard ``dim`` in order, or one group per sharded dim.
        dim: the sharded dim of the layers' inputs (e.g. 2 = H or -1 = W of NCHW), or a tuple
            of them for tiles, e.g. ``(2, 3)`` = H x W over a mesh ``("h", "w")``. Tiles convert
            (transposed) convolutions, GroupNorm and nearest Upsample; BatchNorm2d, linear
            Upsample and pooling are listed as unsupported.
        channels_last: convolutions and pooling take ``[B, *S, C]`` inputs.

    Returns:
        ``module`` itself (or the converted layer when ``module`` itself is a convertible leaf).

    Raises:
        ShardkitError: one error listing every unsupported layer (qualified name and reason),
            raised before anything is converted.
        ShardkitTypeError: ``module`` is not an ``nn.Module``, ``dim`` not an int, bad group.
    """
    op = "apply_spatial"
    if not isinstance(module, nn.Module):
        raise ShardkitTypeError(f"{op}: expected an nn.Module, got {type(module).__name__}")
    tiles = isinstance(dim, (tuple, list)) and len(dim) > 1
    sharded: int | tuple[int, ...]
    groups: Any = mesh_or_group  # tiles: one group per sharded dim
    if isinstance(dim, (tuple, list)) and len(dim) > 1:
        sharded = tuple(dim)
        if any(isinstance(d, bool) or not isinstance(d, int) for d in sharded):
            raise ShardkitTypeError(f"{op}: dim must be an int or a tuple of ints, got {sharded!r}")
        groups = _tile_groups(mesh_or_group, sharded, op)
        for g in groups:
            resolve_group(g, op)
    else:
        one = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
        if isinstance(one, bool) or not isinstance(one, int):
            raise ShardkitTypeError(f"{op}: dim must be an int or a tuple of ints, got {one!r}")
        sharded = one
        resolve_group(mesh_or_group, op)
    problems = [
        f"{name or '<root>'} ({type(m).__name__}): {why}"
        for name, m in module.named_modules()
        if (why := _problem(m, tiles)) is not None
    ]
    if problems:
        raise ShardkitError(
            f"{op}: {len(problems)} layer(s) cannot run on a frame sharded along dim {sharded}: " + "; ".join(problems)
        )
    # check mode: every rank of every sharding group holds the same weights and plan
    plan = [f"dim {dim} channels_last {channels_last}"] + [f"{n} {type(m).__name__}" for n, m in module.named_modules()]
    for g in groups if tiles else [groups]:
        maybe_fingerprint(dict(module.named_parameters()), g, op, plan)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            new = _convert(child, groups, sharded, channels_last)
            if new is not child:
                setattr(parent, name, new)
    return _convert(module, groups, sharded, channels_last)
