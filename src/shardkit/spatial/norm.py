"""Normalization over a frame sharded along spatial dims: GroupNorm and BatchNorm with global statistics.

Each rank computes, per normalized row, its element count ``n_r``, local mean ``m_r`` and
centred sum of squares ``M2_r``; one all-gather of these ``[R, 3, K]`` statistics lets every
rank combine them exactly (Chan et al.'s parallel variance: ``mean = sum n_r m_r / N``,
``M2 = sum M2_r + n_r (m_r - mean)^2``). The centred form avoids the cancellation of the
sum / sum-of-squares form, and the counts make uneven and zero-size shards exact.

The backward is autograd through the combine and :func:`shardkit.all_gather`, whose backward
is a reduce-scatter: each rank's statistics receive the sum over ranks of the gradients flowing
into the (replicated) combined statistics. That sum is needed because every rank's loss
depends on the shared statistics; an all-reduce with an identity backward (Megatron's ``g``)
would drop the other ranks' terms. The affine weight and bias are replicated, so their
gradients are summed over the group once (fused all-reduce).

Collectives per call at ``R > 1``: forward one ``all_gather_single``; backward one
``reduce_scatter_single`` and one ``all_reduce`` (affine parameters). Which spatial dims are
sharded does not matter: the statistics reduce over all of them.

Source: synchronized / cross-replica BatchNorm (e.g. ``torch.nn.SyncBatchNorm``), applied to
spatial shards; Chan, Golub and LeVeque, "Algorithms for computing the sample variance" (1983).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..comm._group import resolve_group
from ..comm._validate import maybe_agree_groups, placeholder
from ..comm.checks import checks_enabled
from ..comm.collectives import all_gather
from ..errors import ShardkitError, ShardkitTypeError
from ._conv_core import _SumParamGrads

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["spatial_group_norm", "SpatialGroupNorm", "SpatialBatchNorm2d"]

_HALF = (torch.float16, torch.bfloat16)


def _global_moments(rows: torch.Tensor, gs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, biased variance and total count of each row of ``rows`` ``[K, M_r]`` over the group(s).

    ``gs``: one ``GroupInfo``, or several (tiles: one group per sharded dim), combined in turn.
    """
    gs = list(gs) if isinstance(gs, (tuple, list)) else [gs]
    n = rows.shape[1]
    mean = rows.sum(1) / max(n, 1)
    m2 = (rows - mean[:, None]).square().sum(1)
    count = torch.full_like(mean, float(n))
    for i, g in enumerate(gs):
        stats = torch.stack([count, mean, m2])  # [3, K]
        table = all_gather(stats.unsqueeze(0), g.pg, 0, [1] * g.size) if g.size > 1 else stats.unsqueeze(0)
        counts, means, m2s = table[:, 0], table[:, 1], table[:, 2]
        total = counts.sum(0)
        # An empty global frame gives NaN statistics, as torch (no host sync to check it); an
        # empty partial one (a row of empty tiles) must not: it weighs 0 in the next combine.
        mean = (counts * means).sum(0) / (total if i == len(gs) - 1 else total.clamp(min=1))
        m2 = (m2s + counts * (means - mean).square()).sum(0)
        count = total
    return mean, m2 / count, count


def _summed(weight, bias, gs, op: str):
    """``weight`` and ``bias`` with their gradients summed over the group(s) in backward (replicated)."""
    for g in gs if isinstance(gs, (tuple, list)) else [gs]:
        params = [p for p in (weight, bias) if p is not None]
        if params and g.size > 1 and torch.is_grad_enabled() and any(p.requires_grad for p in params):
            params = list(_SumParamGrads.apply(g, op, *params))
            weight = params.pop(0) if weight is not None else None
            bias = params.pop(0) if bias is not None else None
    return weight, bias


def _groups(group, op: str):
    """One ``GroupInfo``, or a tuple of them for a sequence of groups (tiles)."""
    if isinstance(group, (tuple, list)) and group:
        return tuple(resolve_group(g, op) for g in group)
    return resolve_group(group, op)


def _affine(x, weight, bias, g, op: str):
    weight, bias = _summed(weight, bias, g, op)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    if weight is not None:
        x = x * weight.view(shape)
    if bias is not None:
        x = x + bias.view(shape)
    return x


def spatial_group_norm(
    x_local: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    group: Group | Sequence[Group],
    eps: float = 1e-5,
) -> torch.Tensor:
    """GroupNorm of a frame sharded along spatial dims; statistics over the whole frame.

    Forward: one all-gather of per-rank (count, mean, M2); backward: its reduce-scatter and
    one all-reduce summing the (replicated) affine gradients.

    Args:
        x_local: ``[B, C, *S_local]``, any spatial dims sharded, any split (zero-size allowed).
        num_groups: ``G``, dividing ``C``.
        weight: ``[C]`` or None, replicated.
        bias: ``[C]`` or None, replicated.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the spatial group), or
            a sequence of them for tiles (e.g. ``(mesh["h"], mesh["w"])``): the statistics are
            combined over each in turn.
        eps: added to the variance, as ``torch.nn.functional.group_norm``.

    Returns:
        ``[B, C, *S_local]``: this rank's block of the unsharded ``group_norm`` output.

    Raises:
        ShardkitError: fewer than 2 dims, ``C`` not divisible by ``G``.
        ShardkitTypeError: ``x_local`` not a tensor, bad group.
    """
    op = "spatial_group_norm"
    g = _groups(group, op)
    gs = g if isinstance(g, tuple) else (g,)
    error: ShardkitError | None = None
    if not isinstance(x_local, torch.Tensor):
        error = ShardkitTypeError(f"{op}: expected a tensor, got {type(x_local).__name__}")
    elif (
        x_local.dim() < 2
        or isinstance(num_groups, bool)
        or not isinstance(num_groups, int)
        or num_groups < 1
        or x_local.shape[1] % num_groups
    ):
        error = ShardkitError(
            f"{op}: expected [B, C, *S] with C divisible by num_groups={num_groups}, got {tuple(x_local.shape)}"
        )
    if checks_enabled():
        # Check mode: B, C, dtype, the groups, eps and the affine shapes set the statistics'
        # all-reduce and the result; the spatial dims may differ (any split), so agree on [B, C].
        meta = x_local.new_empty(x_local.shape[:2]) if error is None else placeholder(gs[0])
        args = (num_groups, eps, getattr(weight, "shape", None), getattr(bias, "shape", None))
        maybe_agree_groups(gs, op, meta, args, error)
    if error is not None:
        raise error
    B, C = x_local.shape[:2]
    half = x_local.dtype in _HALF
    # Half precision: statistics, normalization and affine in float32, one rounding at the end,
    # as torch's own group_norm kernels do (``--verify`` compares against them).
    rows = x_local.reshape(B * num_groups, -1)
    rows = rows.float() if half else rows
    mean, var, _ = _global_moments(rows, g)
    y = ((rows - mean[:, None]) * torch.rsqrt(var + eps)[:, None]).view(x_local.shape)
    if half:
        weight, bias = (None if t is None else t.float() for t in (weight, bias))
    y = _affine(y, weight, bias, g, op)
    return y.to(x_local.dtype) if half else y


class SpatialGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` over a frame sharded along spatial dims (see :func:`spatial_group_norm`).

    Extra keyword argument: ``group``. Same parameters and state-dict keys as ``nn.GroupNorm``.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        group: Group | Sequence[Group],
    ):
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        _groups(group, type(self).__name__)
        self.group = tuple(group) if isinstance(group, (tuple, list)) else group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return spatial_group_norm(x, self.num_groups, self.weight, self.bias, self.group, self.eps)

    @classmethod
    def from_module(cls, gn: nn.GroupNorm, group: Group | Sequence[Group]) -> SpatialGroupNorm:
        """A sharded layer sharing ``gn``'s parameters (no copy)."""
        if type(gn) is not nn.GroupNorm:
            raise ShardkitTypeError(f"{cls.__name__}.from_module: expected an nn.GroupNorm, got {type(gn).__name__}")
        layer = cls(gn.num_groups, gn.num_channels, gn.eps, gn.affine, device="meta", group=group)
        if gn.affine:
            layer.weight, layer.bias = gn.weight, gn.bias
        return layer


class SpatialBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics cover N and the whole sharded frame.

    In training mode the batch mean and variance are those of the unsharded input (one
    all-gather, as :func:`spatial_group_norm`); the running statistics are updated from them
    identically on every rank, so they stay replicated. In eval mode the running statistics are
    used and no communication happens. Same parameters, buffers and state-dict keys as
    ``nn.BatchNorm2d``; extra keyword argument ``group``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        group: Group,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        resolve_group(group, type(self).__name__)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "SpatialBatchNorm2d"
        self._check_input_dim(x)
        g = resolve_group(self.group, op)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch:  # running statistics: local, only the affine gradients are summed
            weight, bias = _summed(self.weight, self.bias, g, op)
            return F.batch_norm(x, self.running_mean, self.running_var, weight, bias, False, 0.0, self.eps)
        C, half = x.shape[1], x.dtype in _HALF
        x_in = x.float() if half else x  # half precision: float32 math, one rounding (as torch)
        rows = x_in.transpose(0, 1).reshape(C, -1)
        mean, var, total = _global_moments(rows, g)
        if self.training and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():  # torch keeps the unbiased variance in running_var
                unbiased = var * total / (total - 1).clamp(min=1)
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach() * factor)
        shape = [1, C] + [1] * (x.dim() - 2)
        y = (x_in - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        weight, bias = (None if t is None else (t.float() if half else t) for t in (self.weight, self.bias))
        y = _affine(y, weight, bias, g, op)
        return y.to(x.dtype) if half else y

    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, group: Group) -> SpatialBatchNorm2d:
        """A sharded layer sharing ``bn``'s parameters and running-statistics buffers (no copy)."""
        if type(bn) is not nn.BatchNorm2d:
            raise ShardkitTypeError(f"{cls.__name__}.from_module: expected an nn.BatchNorm2d, got {type(bn).__name__}")
        layer = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device="meta", group=group)
        for name, p in bn.named_parameters(recurse=False):
            setattr(layer, name, p)
        for name, b in bn.named_buffers(recurse=False):
            layer._buffers[name] = b
        for name in list(layer._buffers):
            if name not in dict(bn.named_buffers(recurse=False)):
                layer._buffers[name] = None
        return layer
