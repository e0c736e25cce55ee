"""Pure exchange plans: which global elements each rank needs, and from whom.

A rank's request is a global range ``[a, b)`` along the sharded dim; positions outside
``[0, N)`` are resolved by a border mode into *segments*:

* ``zeros``: a run of zeros (zero padding, non-periodic halos);
* ``circular``: position ``q`` reads ``q mod N`` (periodic halos, circular padding; wraps as
  often as needed, so a halo may be longer than the whole tensor);
* ``reflect``: ``-q`` before the start, ``2(N-1) - q`` past the end (``torch`` reflect padding:
  the border element is not repeated);
* ``replicate``: the first / last element repeated.

Each segment is then cut at shard boundaries into *pieces* owned by one rank. A plan holds the
pieces of every rank: every rank derives the same plan from metadata all ranks agree on (the
split sizes and the requested ranges), so sender and receiver walk the same list in the same
order and no sizes need to be exchanged. Plans are cached: a training loop reuses them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from .._shapes import split_offsets
from ..errors import ShardkitError

__all__ = ["BORDER_MODES", "Piece", "Plan", "build_plan"]

BORDER_MODES = ("zeros", "circular", "reflect", "replicate")


class Piece(NamedTuple):
    """``length`` elements owned by ``owner`` from global index ``start``, placed as ``mode``.

    ``mode`` is ``copy``, ``flip`` (reversed), ``repeat`` (one element repeated ``out_len``
    times) or ``zero`` (``owner == -1``, ``out_len`` zeros). ``out_len`` is the piece's length
    in the output.
    """

    owner: int
    start: int
    length: int
    mode: str
    out_len: int


class Plan(NamedTuple):
    """The pieces of every rank, and the element counts (along the dim) between ranks.

    ``counts[r][s]``: elements rank ``r`` receives from rank ``s != r`` (``0`` for ``s == r``,
    local pieces are copied, not sent). ``traffic``: whether any rank sends anything, the same
    on every rank, so that all ranks either join the collective or all skip it.
    """

    offsets: tuple[int, ...]
    pieces: tuple[tuple[Piece, ...], ...]
    counts: tuple[tuple[int, ...], ...]
    traffic: bool


def _segments(a: int, b: int, n: int, mode: str) -> list[tuple[int, int, str, int]]:
    """``(start, length, mode, out_len)`` segments covering the padded global range ``[a, b)``."""
    if b <= a:
        return []
    if mode == "circular":
        segs, q = [], a
        while q < b:
            k = q // n
            end = min(b, (k + 1) * n)
            segs.append((q - k * n, end - q, "copy", end - q))
            q = end
        return segs
    left, mid, right = max(0, min(b, 0) - a), (max(a, 0), min(b, n)), max(0, b - max(a, n))
    segs = []
    if left:
        if mode == "zeros":
            segs.append((0, 0, "zero", left))
        elif mode == "replicate":
            segs.append((0, 1, "repeat", left))
        else:  # reflect: positions a..-1 read -a..1, in decreasing order
            segs.append((1 - min(b, 0), left, "flip", left))
    if mid[1] > mid[0]:
        segs.append((mid[0], mid[1] - mid[0], "copy", mid[1] - mid[0]))
    if right:
        if mode == "zeros":
            segs.append((0, 0, "zero", right))
        elif mode == "replicate":
            segs.append((n - 1, 1, "repeat", right))
        else:  # reflect: positions max(a,n)..b-1 read 2(n-1)-q, decreasing
            segs.append((2 * n - 1 - b, right, "flip", right))
    return segs


def _owned(start: int, length: int, offsets: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(owner, start, length)`` sub-runs of the global run ``[start, start + length)``."""
    runs = []
    for r, (off, n) in enumerate(zip(offsets, sizes)):
        lo, hi = max(start, off), min(start + length, off + n)
        if hi > lo:
            runs.append((r, lo, hi - lo))
    return runs


def _pieces(segs, offsets, sizes) -> list[Piece]:
    pieces = []
    for start, length, mode, out_len in segs:
        if mode == "zero":
            pieces.append(Piece(-1, 0, 0, "zero", out_len))
            continue
        runs = _owned(start, length, offsets, sizes)
        if mode == "flip":
            runs.reverse()  # flip(cat(u, v)) == cat(flip(v), flip(u))
        for owner, lo, ln in runs:
            pieces.append(Piece(owner, lo, ln, mode, out_len if mode == "repeat" else ln))
    return pieces


@functools.lru_cache(maxsize=256)
def build_plan(sizes: tuple[int, ...], ranges: tuple[tuple[int, int], ...], mode: str) -> Plan:
    """The exchange plan for per-rank requests ``ranges[r] = (a_r, b_r)`` over shards ``sizes``.

    Args:
        sizes: per-rank shard sizes along the dim (global size ``N = sum(sizes)``).
        ranges: the global range each rank needs (may extend past ``[0, N)``).
        mode: a border mode of :data:`BORDER_MODES`.

    Raises:
        ShardkitError: ``circular`` over an empty dim, or ``reflect`` / ``replicate`` whose
            request cannot be served by one reflection of a non-empty dim (torch's limit:
            reflect padding < N).
    """
    n = sum(sizes)
    offsets = split_offsets(sizes)
    if mode not in BORDER_MODES:
        raise ShardkitError(f"unknown border mode {mode!r}; expected one of {BORDER_MODES}")
    for r, (a, b) in enumerate(ranges):
        if b <= a or (0 <= a and b <= n):
            continue
        if n == 0 and mode != "zeros":
            raise ShardkitError(f"{mode} border over an empty global dim (sizes={list(sizes)}), requested by rank {r}")
        if mode == "reflect" and (-a > n - 1 or b - 1 > 2 * (n - 1)):
            raise ShardkitError(
                f"reflect border needs padding < the global size {n}; "
                f"rank {r} requests [{a}, {b}) (sizes={list(sizes)})"
            )
    pieces = tuple(tuple(_pieces(_segments(a, b, n, mode), offsets, sizes)) for a, b in ranges)
    R = len(sizes)
    counts = tuple(
        tuple(sum(p.length for p in pieces[r] if p.owner == s) if s != r else 0 for s in range(R)) for r in range(R)
    )
    return Plan(tuple(offsets), pieces, counts, any(any(row) for row in counts))
