"""Argument checks shared by the public collectives.

Order matters for "same error on every rank": the group is resolved first, then (in check mode)
metadata is agreed collectively, and only then are local checks run. Local checks that depend
on this rank's own shape come last, so with checks on they never fire before the agreement.
"""

from __future__ import annotations

import torch

from .._shapes import balanced_split_sizes, check_split_sizes, normalize_dim
from ..errors import ShardkitError, ShardkitTypeError
from ._group import GroupInfo, resolve_group
from .checks import agree, checks_enabled

GRAD_SCALES = (None, "up", "down")


def enter(x, group, op: str) -> GroupInfo:
    """Type-check the tensor and resolve the group."""
    if not isinstance(x, torch.Tensor):
        raise ShardkitTypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.requires_grad and not (x.is_floating_point() or x.is_complex()):
        raise ShardkitTypeError(f"{op}: only floating-point or complex tensors can require grad, got {x.dtype}")
    return resolve_group(group, op)


def maybe_agree(g: GroupInfo, op: str, x: torch.Tensor, args=(), local_dim=None, expected_local=None) -> None:
    """Cross-rank metadata agreement when the check mode is on (see :mod:`.checks`)."""
    if checks_enabled() and g.size > 1:
        agree(g, op, x, tuple(_int_args(args)), local_dim, expected_local)


def _int_args(args):
    for a in args:
        if a is None:
            yield -3
        elif isinstance(a, (list, tuple)):
            yield len(a)
            yield from (int(v) if isinstance(v, int) else -4 for v in a)
        elif isinstance(a, int):
            yield int(a)
        else:
            yield -4


def expected_size(sizes, rank: int):
    """``sizes[rank]`` when it is a well-formed list, else None (the plain checks report it)."""
    try:
        return int(sizes[rank]) if sizes is not None else None
    except (TypeError, IndexError, ValueError):
        return None


def dim_of(x: torch.Tensor, dim: int, op: str) -> int:
    return normalize_dim(dim, x.dim(), op)


def local_sizes(x: torch.Tensor, g: GroupInfo, dim: int, sizes, op: str) -> list[int]:
    """Per-rank sizes of a dim sharded across the group, checked against this rank's block.

    With ``sizes=None`` every rank must hold the same size (it cannot be checked locally; the
    check mode does it). With explicit sizes, ``sizes[rank]`` must equal the local size.
    """
    n = x.shape[dim]
    if sizes is None:
        return [n] * g.size
    sizes = check_split_sizes(sizes, g.size, None, op)
    if sizes[g.rank] != n:
        raise ShardkitError(
            f"{op}: rank {g.rank} of {g.size} holds {n} elements along dim {dim} but sizes[{g.rank}] = "
            f"{sizes[g.rank]} (sizes={sizes})"
        )
    return sizes


def full_sizes(x: torch.Tensor, g: GroupInfo, dim: int, sizes, op: str) -> list[int]:
    """Split sizes of a full (replicated) dim: explicit and summing to it, or balanced."""
    return check_split_sizes(sizes, g.size, x.shape[dim], op)


def grad_scale_factor(grad_scale, x: torch.Tensor, g: GroupInfo, op: str) -> float | None:
    """Multiplier applied to the gradient: None, R ("up") or 1/R ("down")."""
    if grad_scale not in GRAD_SCALES:
        raise ShardkitError(f"{op}: grad_scale must be None, 'up' or 'down', got {grad_scale!r}")
    if grad_scale is not None and not (x.is_floating_point() or x.is_complex()):
        raise ShardkitTypeError(
            f"{op}: grad_scale={grad_scale!r} needs a floating-point tensor (no gradient flows through {x.dtype})"
        )
    if grad_scale == "up":
        return float(g.size)
    if grad_scale == "down":
        return 1.0 / g.size
    return None


__all__ = ["enter", "maybe_agree", "expected_size", "dim_of", "local_sizes", "full_sizes", "grad_scale_factor", "balanced_split_sizes"]
