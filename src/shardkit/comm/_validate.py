"""Argument checks shared by the public collectives.

Order matters for "same error on every rank": the group is resolved first, then (in check mode)
metadata is agreed collectively, and only then are local checks run. Local checks that depend
on this rank's own shape come last, so with checks on they never fire before the agreement.
"""

from __future__ import annotations

import struct
import zlib

import torch

from .._shapes import balanced_split_sizes, check_split_sizes, normalize_dim
from ..errors import ShardkitError, ShardkitTypeError
from . import ledger
from ._cache import plan_cache
from ._compat import all_gather_single
from ._group import GroupInfo, group_device, resolve_group
from .checks import agree, checks_enabled, covered

GRAD_SCALES = (None, "up", "down")


def enter(x, group, op: str) -> GroupInfo:
    """Resolve the group, then type-check the tensor.

    A bad tensor can be one rank's alone (``x`` a list there, or an integer tensor that requires
    grad): in check mode its error is agreed like any local check (:func:`raise_agreed`), so
    every rank raises it instead of the others waiting in the op's first collective.
    """
    g = resolve_group(group, op)
    error: ShardkitError | None = None
    if not isinstance(x, torch.Tensor):
        error = ShardkitTypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    elif x.requires_grad and not (x.is_floating_point() or x.is_complex()):
        error = ShardkitTypeError(f"{op}: only floating-point or complex tensors can require grad, got {x.dtype}")
    if error is not None:
        raise_agreed(g, op, error)
    return g


def placeholder(g: GroupInfo) -> torch.Tensor:
    """The agreement's stand-in for an input this rank does not have (its error is agreed instead)."""
    return torch.empty(0, device=group_device(g))


def raise_agreed(g: GroupInfo, op: str, error: Exception) -> None:
    """Raise ``error`` (this rank's, found before it has a tensor to agree on); in check mode on
    every rank of the group, through the same agreement as the op's peers are entering."""
    if checks_enabled() and g.size > 1:
        agree(g, op, placeholder(g), error=error)
    raise error


def maybe_agree(g: GroupInfo, op: str, x: torch.Tensor, args=(), local_dim=None, expected_local=None, error=None):
    """Cross-rank metadata agreement when the check mode is on (see :mod:`.checks`).

    Returns every rank's size along ``local_dim`` as the agreed table holds it (so that an op
    without ``sizes=`` need not gather them a second time), or None when nothing was agreed.
    ``error``: this rank's local check error (from :func:`local_checks`), raised on every rank.
    """
    if checking(g):
        return agree(g, op, x, tuple(_int_args(args)) if error is None else (), local_dim, expected_local, error)
    if error is not None:
        raise error
    return None


def maybe_agree_groups(gs, op: str, x: torch.Tensor, args=(), error=None, local_dim=None, expected_local=None):
    """:func:`maybe_agree` over several groups (the dims of a mesh, tiles), one after another.

    A disagreement or local error found in one group is carried into the next agreement instead
    of raised at once (a rank raising early would leave the peers of its other groups waiting),
    and the last group's verdict is raised: each agreement hands its ranks one text. Returns
    the first group's agreed sizes along ``local_dim`` (see :func:`maybe_agree`).
    """
    first = None
    for i, g in enumerate(gs):
        try:
            known = maybe_agree(g, op, x, args, local_dim, expected_local, error)
            first = known if i == 0 else first
        except ShardkitError as exc:
            error = exc
    if error is not None:
        raise error
    return first


def local_checks(g: GroupInfo, fn):
    """``(fn(), None)``, or in check mode ``(None, error)`` when ``fn`` raises a ShardkitError.

    Checks of this rank's own tensors can fail on one rank only. In check mode the error is
    handed to :func:`maybe_agree` instead of raised, so that every rank raises it; otherwise
    it is raised here as before.
    """
    try:
        return fn(), None
    except ShardkitError as exc:
        if not checking(g):
            raise
        return None, exc


def checking(g: GroupInfo) -> bool:
    """Check mode on, more than one rank, and not inside a region whose agreement covers the group."""
    return checks_enabled() and g.size > 1 and not covered(g.pg)


def _int_args(args):
    """Every argument as ints, so that ranks agree on all of it: ints as they are, floats by their
    bits, strings by a checksum, sequences (sizes, kernel, a whole ``cu_seqlens``) as their
    length and elements."""
    for a in args:
        if a is None:
            yield -3
        elif isinstance(a, (bool, int)):
            yield int(a)
        elif isinstance(a, float):
            yield struct.unpack("<q", struct.pack("<d", a))[0]
        elif isinstance(a, str):
            yield zlib.crc32(a.encode())
        elif isinstance(a, torch.Tensor) and a.dim() <= 1 and not (a.is_floating_point() or a.is_complex()):
            values = a.tolist() if a.dim() else [a.item()]
            yield len(values)
            yield from (int(v) for v in values)
        elif isinstance(a, (list, tuple, torch.Size)):
            yield len(a)
            yield from _int_args(a)
        else:
            yield -4


def gather_sizes(x: torch.Tensor, g: GroupInfo, dim: int, api: str, known=None) -> list[int]:
    """Every rank's size of ``x`` along ``dim``: one tiny int64 all-gather.

    The metadata step of every op called without its global sizes (ledger op
    ``metadata_all_gather``, phase ``"metadata"``): each rank learns its peers' sizes instead of
    assuming they equal its own, so uneven shards just work. ``known`` is the list the check
    mode's agreement already gathered (no second collective then). Size-1 groups need none.
    """
    if known is not None:
        return list(known)
    return gather_ints(x.shape[dim], g, api, x.device)


def gather_ints(value: int, g: GroupInfo, api: str, device=None) -> list[int]:
    """``value`` of every rank of the group, in rank order (one int64 all-gather; none when ``R == 1``)."""
    if g.size == 1:
        return [int(value)]
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    table = mine.new_empty(g.size)
    ledger.record("metadata_all_gather", api, "metadata", g.size, mine.nbytes, table.nbytes, pg=g.pg, shape=(1,))
    all_gather_single(table, mine, group=g.pg)
    return [int(v) for v in table.tolist()]


def expected_size(sizes, rank: int):
    """``sizes[rank]`` when it is a well-formed list, else None (the plain checks report it)."""
    try:
        return int(sizes[rank]) if sizes is not None else None
    except (TypeError, IndexError, ValueError):
        return None


def dim_of(x: torch.Tensor, dim: int, op: str) -> int:
    return normalize_dim(dim, x.dim(), op)


def local_sizes(x: torch.Tensor, g: GroupInfo, dim: int, sizes, op: str, known=None) -> list[int]:
    """Per-rank sizes of a dim sharded across the group, checked against this rank's block.

    With ``sizes=None`` they are learned with one metadata all-gather (:func:`gather_sizes`;
    ``known``: the sizes the check mode already agreed on). With explicit sizes, no
    communication: ``sizes[rank]`` must equal the local size.
    """
    if sizes is None:
        return gather_sizes(x, g, dim, op, known)
    return _checked_local(sizes, x.shape[dim], dim, g.size, g.rank, op)


def _checked_local(sizes, n: int, dim: int, size: int, rank: int, op: str) -> list[int]:
    sizes = check_split_sizes(sizes, size, None, op)
    if sizes[rank] != n:
        raise ShardkitError(
            f"{op}: rank {rank} of {size} holds {n} elements along dim {dim} but sizes[{rank}] = "
            f"{sizes[rank]} (sizes={sizes})"
        )
    return sizes


def _plain_ints(sizes) -> tuple[int, ...] | None:
    """``sizes`` as a tuple when it is a list or tuple of plain ints (a cache key that tells every
    accepted value apart: ``True == 1`` and numpy ints hash like ints, so their types are checked
    here), else None."""
    # map/set rather than a generator: no Python frame per rank on every call of a sized op
    if type(sizes) in (list, tuple) and set(map(type, sizes)) <= {int}:
        return tuple(sizes)
    return None


@plan_cache(1024)
def _sharded_cached(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...], size: int, rank: int, op: str):
    d = normalize_dim(dim, len(shape), op)
    return d, tuple(_checked_local(list(sizes), shape[d], d, size, rank, op))


@plan_cache(1024)
def _full_cached(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...] | None, size: int, op: str):
    d = normalize_dim(dim, len(shape), op)
    return d, tuple(check_split_sizes(None if sizes is None else list(sizes), size, shape[d], op))


def sharded_dim(x: torch.Tensor, g: GroupInfo, dim, sizes, op: str, known=None):
    """``(dim_of(x, dim), local_sizes(x, g, dim, sizes))`` (sizes as a tuple when explicit).

    Explicit plain-int sizes and dim: computed once per (shape, dim, sizes, group size, rank,
    op), everything the checks read; a failing check is not cached, so it raises the same error
    every call. Anything else (sizes to learn, other types) is checked as :func:`local_sizes` does, uncached.
    """
    key = _plain_ints(sizes) if type(dim) is int else None
    if key is None:
        d = dim_of(x, dim, op)
        return d, local_sizes(x, g, d, sizes, op, known)
    return _sharded_cached(x.shape, dim, key, g.size, g.rank, op)


def full_dim(x: torch.Tensor, g: GroupInfo, dim, sizes, op: str):
    """``(dim_of(x, dim), full_sizes(x, g, dim, sizes))``, cached like :func:`sharded_dim`."""
    key = None if sizes is None else _plain_ints(sizes)
    if type(dim) is not int or (sizes is not None and key is None):
        d = dim_of(x, dim, op)
        return d, full_sizes(x, g, d, sizes, op)
    return _full_cached(x.shape, dim, key, g.size, op)


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


__all__ = [
    "enter",
    "group_device",
    "placeholder",
    "raise_agreed",
    "maybe_agree",
    "maybe_agree_groups",
    "local_checks",
    "gather_sizes",
    "gather_ints",
    "expected_size",
    "dim_of",
    "local_sizes",
    "full_sizes",
    "grad_scale_factor",
    "balanced_split_sizes",
    "sharded_dim",
    "full_dim",
    "checking",
]
