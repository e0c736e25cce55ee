"""Upsampling (``interpolate``) of an input sharded along one spatial dim, integer scale factors.

* ``nearest`` / ``nearest-exact``: output ``o`` reads input ``o // s``, so each rank upsamples
  its own shard: no communication, output sizes ``s * sizes``.
* ``linear`` / ``bilinear`` / ``trilinear`` with ``align_corners=False``: output ``o`` reads
  input positions ``floor(c)`` and ``floor(c) + 1`` around ``c = (o + 0.5) / s - 0.5``, clamped
  to the frame. A one-element halo on each side, replicating the global border elements,
  makes the local interpolation of the padded shard equal to the global one on its middle
  ``s * n_r`` outputs (the replicated border reproduces torch's clamping), so the halo plan of
  :mod:`.halo` (one ``all_to_all_single`` each way) is all the communication.

Over H x W tiles (a group per sharded dim) only the nearest modes are supported: they read
nothing outside the own tile, so the tile grid does not matter; the linear modes would need a
corner-carrying halo per dim, as the tiled convolutions do, and are refused.

Not supported (ShardkitError): non-integer scales, ``size=``, ``align_corners=True`` (its
coordinate map depends on the global size), ``bicubic`` and ``area``; linear modes over tiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch.nn.functional as F
from torch import nn

from .._shapes import split_offsets
from ..comm._group import resolve_group
from ..comm._validate import dim_of, enter, expected_size, local_sizes, maybe_agree
from ..errors import ShardkitError, ShardkitTypeError
from ._meta import channels_first, gather_sizes, keep_graph_empty
from .halo import exchange, plan_for

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from .._types import Group

__all__ = ["spatial_interpolate", "SpatialUpsample"]

_NEAREST = ("nearest", "nearest-exact")
_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}


def _scales(scale_factor, nd: int, op: str) -> tuple[int, ...]:
    values = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * nd
    if len(values) != nd:
        raise ShardkitError(f"{op}: scale_factor needs {nd} value(s), got {scale_factor!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 or int(v) != v:
            raise ShardkitError(f"{op}: only integer scale factors >= 1 are supported, got {scale_factor!r}")
        out.append(int(v))
    return tuple(out)


def check_interpolate_args(scale_factor, mode, align_corners, nd: int, op: str, size=None) -> tuple[int, ...]:
    """The integer scales, or a ShardkitError for what the sharded path does not support."""
    if size is not None:
        raise ShardkitError(f"{op}: size= is not supported on a sharded input; pass an integer scale_factor")
    if mode not in _NEAREST and mode not in _LINEAR:
        raise ShardkitError(
            f"{op}: mode {mode!r} is not supported; use nearest, nearest-exact, linear, bilinear or trilinear"
        )
    if mode in _LINEAR and _LINEAR[mode] != nd:
        raise ShardkitError(f"{op}: mode {mode!r} needs {_LINEAR[mode]} spatial dim(s), got {nd}")
    if mode in _LINEAR and align_corners:
        raise ShardkitError(
            f"{op}: align_corners=True is not supported (its coordinate map depends on the global size)"
        )
    return _scales(scale_factor, nd, op)


def _agree_args(x_local, group, dim, scale_factor, mode, align_corners, sizes, channels_last, op, error=None):
    g = enter(x_local, group, op)
    # nearest is local: any split works without sizes, so only the other dims must agree
    own = x_local.shape[dim] if mode in _NEAREST and -x_local.dim() <= dim < x_local.dim() else None
    maybe_agree(
        g,
        op,
        x_local,
        (dim, int(bool(channels_last)), int(x_local.requires_grad), sizes, scale_factor, str(mode), align_corners),
        local_dim=dim,
        expected_local=own if own is not None else expected_size(sizes, g.rank),
        error=error,
    )
    return g


def spatial_interpolate(
    x_local: torch.Tensor,
    group: Group | Sequence[Group],
    dim: int | Sequence[int],
    scale_factor: int | Sequence[int],
    mode: str = "nearest",
    align_corners: bool | None = None,
    *,
    sizes: Sequence[int] | None = None,
    channels_last: bool = False,
) -> torch.Tensor:
    """``F.interpolate`` of an input sharded along ``dim`` with integer scales; output sharded the same way.

    Args:
        x_local: ``[B, C, *S_local]`` (``[B, *S_local, C]`` with ``channels_last``), sharded along ``dim``.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks; over tiles, one per sharded dim.
        dim: the sharded spatial dim (negative allowed); over tiles, a tuple (nearest modes only).
        scale_factor: an int, or one int per spatial dim.
        mode: ``nearest``, ``nearest-exact`` (local, no communication), ``linear`` /
            ``bilinear`` / ``trilinear`` (one-element replicate halo).
        align_corners: None or False.
        sizes: every rank's size along ``dim`` (linear modes only; None = equal sizes).

    Returns:
        This rank's block of the unsharded output, ``scale * sizes[rank]`` long along ``dim``.

    Raises:
        ShardkitError: unsupported mode, scale or ``align_corners`` (see module docstring),
            ``dim`` not spatial, bad ``sizes``, a linear mode over tiles.
    """
    op = "spatial_interpolate"
    if isinstance(dim, (tuple, list)):  # tiles: nearest only, checked per sharded dim
        if mode not in _NEAREST or sizes is not None:
            raise ShardkitError(
                f"{op}: over tiles (dims {tuple(dim)}) only nearest modes without sizes= are "
                f"supported, got mode={mode!r}"
            )
        if not isinstance(group, (tuple, list)) or len(group) != len(dim):
            raise ShardkitError(f"{op}: {len(dim)} sharded dims {tuple(dim)} need {len(dim)} groups, got {group!r}")
        error = None  # one tile group's verdict is carried into the next, as maybe_agree_groups does
        for tile_group, tile_dim in zip(group, dim):
            try:
                _agree_args(
                    x_local, tile_group, tile_dim, scale_factor, mode, align_corners, sizes, channels_last, op, error
                )
            except ShardkitError as exc:
                error = exc
        if error is not None:
            raise error
        one: int = dim[0]  # nearest reads only the own tile: the dim only places the channels
    else:
        if not isinstance(dim, int) or isinstance(group, (tuple, list)):
            raise ShardkitTypeError(f"{op}: one sharded dim takes an int dim and one group, got {dim!r}, {group!r}")
        one = dim
        g = _agree_args(x_local, group, dim, scale_factor, mode, align_corners, sizes, channels_last, op)
    nd = x_local.dim() - 2
    if nd < 1:
        raise ShardkitError(f"{op}: expected [B, C, *S] with at least one spatial dim, got {tuple(x_local.shape)}")
    scales = check_interpolate_args(scale_factor, mode, align_corners, nd, op)
    d = dim_of(x_local, one, op)
    xc, dc = channels_first(x_local, d, nd, channels_last, one, op)
    if mode in _NEAREST:  # output o reads o // s: each rank's own shard, exactly
        out = xc
        for i, s in enumerate(scales):
            if s > 1:
                out = out.repeat_interleave(s, dim=2 + i)
    else:
        sizes = local_sizes(xc, g, dc, sizes, op)
        offsets = split_offsets(sizes)
        ranges = tuple((o - 1, o + n + 1) if n else (0, 0) for o, n in zip(offsets, sizes))
        seg = exchange(xc, g, dc, plan_for(op, sizes, ranges, "replicate"), op)
        n, s = sizes[g.rank], scales[dc - 2]
        if n == 0:
            shape = [xc.shape[0], xc.shape[1], *(m * k for m, k in zip(xc.shape[2:], scales))]
            out = keep_graph_empty(shape, seg)
        else:
            up = F.interpolate(seg, scale_factor=tuple(float(v) for v in scales), mode=mode, align_corners=False)
            out = up.narrow(dc, s, n * s)
    return out.movedim(1, -1) if channels_last else out


class SpatialUpsample(nn.Module):
    """``nn.Upsample`` (integer ``scale_factor``) over an input sharded along ``dim``.

    See :func:`spatial_interpolate`. No parameters; ``infer_sizes`` all-gathers the split sizes
    in forward when none are passed (linear modes only; set by :func:`apply_spatial`). Over
    tiles, ``group`` and ``dim`` are tuples (one group per sharded dim) and ``mode`` must be a
    nearest mode.
    """

    def __init__(
        self,
        scale_factor: int | Sequence[int],
        mode: str = "nearest",
        align_corners: bool | None = None,
        *,
        group: Group | Sequence[Group],
        dim: int | Sequence[int],
        channels_last: bool = False,
        infer_sizes: bool = False,
    ):
        super().__init__()
        dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        if any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise ShardkitTypeError(f"SpatialUpsample: dim must be an int or a tuple of ints, got {dim!r}")
        self.group: Group | tuple[Group, ...]
        self.dim: int | tuple[int, ...]
        if isinstance(dim, (tuple, list)):  # tiles
            if mode not in _NEAREST or not isinstance(group, (tuple, list)) or len(group) != len(dims):
                raise ShardkitError(
                    f"SpatialUpsample: over tiles (dims {dims}) only nearest modes with one group per "
                    f"dim are supported, got mode={mode!r}, group={group!r}"
                )
            self.group, self.dim = tuple(group), dims
        elif isinstance(group, (tuple, list)):
            raise ShardkitTypeError(f"SpatialUpsample: one sharded dim {dim} takes one group, got {group!r}")
        else:
            self.group, self.dim = cast("Group", group), dims[0]
        for g in self.group if isinstance(self.group, tuple) else (self.group,):
            resolve_group(g, "SpatialUpsample")
        self.scale_factor, self.mode, self.align_corners = scale_factor, mode, align_corners
        self.channels_last, self.infer_sizes = bool(channels_last), bool(infer_sizes)

    def forward(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
        if sizes is None and self.infer_sizes and self.mode not in _NEAREST:  # linear modes: never tiles
            assert not isinstance(self.group, tuple) and isinstance(self.dim, int)
            g = resolve_group(self.group, "SpatialUpsample")
            sizes = gather_sizes(x, g, dim_of(x, self.dim, "SpatialUpsample"), "SpatialUpsample")
        return spatial_interpolate(
            x,
            self.group,
            self.dim,
            self.scale_factor,
            self.mode,
            self.align_corners,
            sizes=sizes,
            channels_last=self.channels_last,
        )

    def extra_repr(self) -> str:
        return f"scale_factor={self.scale_factor}, mode={self.mode!r}, dim={self.dim}"

    @classmethod
    def from_module(
        cls,
        up: nn.Upsample,
        group: Group | Sequence[Group],
        dim: int | Sequence[int],
        *,
        channels_last: bool = False,
        infer_sizes: bool = False,
    ) -> SpatialUpsample:
        """The sharded equivalent of ``up``; ShardkitError when its settings are unsupported."""
        if up.size is not None or up.scale_factor is None:
            raise ShardkitError("SpatialUpsample.from_module: size= is not supported; use an integer scale_factor")
        # nn.Upsample stores floats (2 -> 2.0); the sharded path takes whole factors only
        factors = up.scale_factor if isinstance(up.scale_factor, tuple) else (up.scale_factor,)
        if not all(float(f).is_integer() for f in factors):
            raise ShardkitError(
                f"SpatialUpsample.from_module: only integer scale factors >= 1 are supported, got {up.scale_factor!r}"
            )
        whole = tuple(int(f) for f in factors)
        return cls(
            whole if isinstance(up.scale_factor, tuple) else whole[0],
            up.mode,
            up.align_corners,
            group=group,
            dim=dim,
            channels_last=channels_last,
            infer_sizes=infer_sizes,
        )
