"""Which blocks ring attention computes, from the global positions of the tokens (pure, cached).

Each rank's local tokens are a sequence of *pieces*: runs of consecutive global positions of
one document (zigzag: per document, chunks ``r`` and ``2R - 1 - r`` of its own balanced split;
contiguous: the part of each document inside block ``r``). Without a causal mask or a window
the two zigzag chunks of a document form one piece, since only the document matters. A query piece
``qp`` and a key piece ``kp`` are:

* hidden (``NONE``) when their documents differ, or, causal, when every key follows every query,
  or, with a window ``(left, right)``, when every key lies outside every query's window (all keys
  before ``q_first - left`` or after ``q_last + right``): such blocks are skipped, no compute;
* fully visible (``ALL``) in the same document when every (query, key) pair is visible: no
  causal mask and no window, or every key precedes (or is) every query and lies inside every
  query's window (``k_first >= q_last - left``, ``k_last <= q_first + right``): no mask;
* ``DIAG`` when both are the same chunk (square, lower-triangular: ``is_causal``) and the window
  covers the whole chunk (``left >= n - 1``);
* partially covered (``PARTIAL``) otherwise: the block runs with an explicit boolean mask of
  the visible pairs (the window's band, cropped to the rows and columns that see anything).

Pieces form the blocks' *tiles*. With several documents, consecutive pieces shorter than
``min_tile`` tokens share a tile so that many short documents do not cost one kernel call each
per piece pair; a tile pair mixing kinds then runs with an explicit boolean mask (document id
and position of both sides), cropped to the rows and columns that see anything. Tile pairs
with nothing visible are skipped (no compute), fully visible ones need no mask, a lone
diagonal pair runs ``is_causal``. With one document ``min_tile`` is ignored, so the blocks are
the chunk pairs of ring attention (zigzag: ``2R + 1`` of ``4R`` causal pairs per rank).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._shapes import balanced_split_sizes, split_offsets
from ._options import visible
from ._sizes import _zigzag_ranges

__all__ = ["Block", "block_plan", "rank_pieces"]

NONE, ALL, DIAG, PARTIAL = range(4)


@dataclass(frozen=True)
class Piece:
    """Local tokens ``off:off + n`` are global positions ``g0:g0 + n`` of document ``doc``."""

    doc: int
    g0: int
    off: int
    n: int


@dataclass(frozen=True)
class Block:
    """One block to compute: local queries ``q_off:q_off + q_n`` against keys ``k_off:k_off + k_n``.

    ``kind`` is ``"full"``, ``"diag"`` (``is_causal``) or ``"mask"`` (with ``mask``, bool ``[q_n, k_n]``).
    """

    q_off: int
    q_n: int
    k_off: int
    k_n: int
    kind: str
    mask: torch.Tensor | None = None


def rank_pieces(layout: str, cu: tuple[int, ...], world_size: int, rank: int, causal: bool) -> list[Piece]:
    """The pieces of rank ``rank``'s local tokens, in local order (empty ones left out).

    ``causal``: positions matter (a causal mask or a window); False merges a document's pieces."""
    out, off = [], 0
    if layout == "contiguous":
        sizes = balanced_split_sizes(cu[-1], world_size)
        lo = split_offsets(sizes)[rank]
        hi = lo + sizes[rank]
    for d in range(len(cu) - 1):
        if layout == "zigzag":
            ranges = list(_zigzag_ranges(cu[d], cu[d + 1] - cu[d], world_size, rank))
        else:
            ranges = [(max(lo, cu[d]), min(hi, cu[d + 1]))]
        ranges = [(b, e) for b, e in ranges if e > b]
        if not causal and ranges:  # only the document matters: one piece (global start unused)
            ranges = [(ranges[0][0], ranges[0][0] + sum(e - b for b, e in ranges))]
        for b, e in ranges:
            out.append(Piece(d, b, off, e - b))
            off += e - b
    return out


def _tiles(pieces: list[Piece], min_tile: int) -> list[list[Piece]]:
    """Consecutive pieces shorter than ``min_tile`` share a tile until it reaches ``min_tile`` tokens."""
    tiles: list[list[Piece]] = []
    for p in pieces:
        last = tiles[-1] if tiles else None
        if (
            last is not None
            and p.n < min_tile
            and sum(x.n for x in last) < min_tile
            and all(x.n < min_tile for x in last)
        ):
            last.append(p)
        else:
            tiles.append([p])
    return tiles


def _kind(qp: Piece, kp: Piece, causal: bool, window: tuple[int, int] | None) -> int:
    """The kind of a piece pair (module docstring) from the bounds of both position ranges."""
    if qp.doc != kp.doc:
        return NONE
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right  # the causal mask is the window's right bound 0
    q0, q1, k0, k1 = qp.g0, qp.g0 + qp.n - 1, kp.g0, kp.g0 + kp.n - 1
    if (right >= 0 and k0 > q1 + right) or (left >= 0 and k1 < q0 - left):
        return NONE
    if (right < 0 or k1 <= q0 + right) and (left < 0 or k0 >= q1 - left):
        return ALL
    if causal and (kp.g0, kp.n) == (qp.g0, qp.n) and (left < 0 or left >= qp.n - 1):
        return DIAG
    return PARTIAL


def _piece_mask(qp: Piece, kp: Piece, kind: int, causal: bool, window) -> torch.Tensor:
    if kind in (NONE, ALL):
        return torch.full((qp.n, kp.n), kind == ALL, dtype=torch.bool)
    return visible(torch.arange(qp.g0, qp.g0 + qp.n), torch.arange(kp.g0, kp.g0 + kp.n), causal, window)


def _tile_blocks(qt: list[Piece], kt: list[Piece], causal: bool, window) -> list[Block]:
    kinds = [[_kind(qp, kp, causal, window) for kp in kt] for qp in qt]
    flat = [x for row in kinds for x in row]
    q_off, k_off = qt[0].off, kt[0].off
    q_n, k_n = sum(p.n for p in qt), sum(p.n for p in kt)
    if all(x == NONE for x in flat):
        return []
    if all(x == ALL for x in flat):
        return [Block(q_off, q_n, k_off, k_n, "full")]
    if flat == [DIAG]:
        return [Block(q_off, q_n, k_off, k_n, "diag")]
    mask = torch.cat(
        [
            torch.cat([_piece_mask(qp, kp, kinds[i][j], causal, window) for j, kp in enumerate(kt)], 1)
            for i, qp in enumerate(qt)
        ],
        0,
    )
    rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
    r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    mask = mask[r0:r1, c0:c1].contiguous()
    if bool(mask.all()):
        return [Block(q_off + r0, r1 - r0, k_off + c0, c1 - c0, "full")]
    return [Block(q_off + r0, r1 - r0, k_off + c0, c1 - c0, "mask", mask)]


def _stripe_blocks(seq_len: int, world_size: int, q_rank: int, kv_rank: int, causal: bool) -> tuple[Block, ...]:
    """Stripe layout (rank ``r`` holds global tokens ``r, r + R, r + 2R, ...``): one block per pair.

    Local query ``a`` of rank ``r`` is position ``r + R a``, local key ``b`` of rank ``s`` is
    ``s + R b``; causal visibility ``s + R b <= r + R a`` is ``b <= a`` when ``s <= r`` (the
    diagonal block of the first ``n_q`` keys: rank ``s`` holds at least as many tokens) and
    ``b < a`` when ``s > r`` (queries ``1..`` against keys ``..n_q - 2``, again a diagonal block).
    Every rank computes one (triangular) block per step: balanced, as Striped Attention intends.
    """
    nq, nk = len(range(q_rank, seq_len, world_size)), len(range(kv_rank, seq_len, world_size))
    if not causal:
        return (Block(0, nq, 0, nk, "full"),) if nq and nk else ()
    if kv_rank <= q_rank:
        return (Block(0, nq, 0, nq, "diag"),) if nq else ()
    return (Block(1, nq - 1, 0, nq - 1, "diag"),) if nq > 1 else ()


@functools.lru_cache(maxsize=256)
def block_plan(
    layout: str,
    cu: tuple[int, ...],
    world_size: int,
    q_rank: int,
    kv_rank: int,
    causal: bool,
    min_tile: int,
    window: tuple[int, int] | None = None,
) -> tuple[Block, ...]:
    """Blocks rank ``q_rank``'s queries compute against rank ``kv_rank``'s KV block (masks on CPU).

    ``window``: the normalized ``(left, right)`` of :func:`._options.variant`, or None.
    Cached: a pure function of the layout, reused by backward and by every training step.
    """
    if layout == "stripe":  # one sequence, no window (checked by ring_attention)
        return _stripe_blocks(cu[-1], world_size, q_rank, kv_rank, causal)
    tile = min_tile if len(cu) > 2 else 0
    positional = causal or window is not None
    q_tiles = _tiles(rank_pieces(layout, cu, world_size, q_rank, positional), tile)
    k_tiles = _tiles(rank_pieces(layout, cu, world_size, kv_rank, positional), tile)
    return tuple(b for qt in q_tiles for kt in k_tiles for b in _tile_blocks(qt, kt, causal, window))


def rank_work(
    layout: str, cu: tuple[int, ...], world_size: int, causal: bool = True, window: tuple[int, int] | None = None
) -> list[int]:
    """Visible (query, key) pairs each rank computes over a whole ring pass, from the block plan.

    A diagonal block counts ``n (n + 1) / 2``, a masked one its True entries, a full one
    ``q_n x k_n``: the attention work (and, with the fused kernels skipping nothing inside a
    block, a lower bound of its time). ``max / mean`` is the layout's load balance: the slowest
    rank sets the ring's pace, since every step waits for the next KV block.
    """
    work = []
    for r in range(world_size):
        total = 0
        for s in range(world_size):
            for b in block_plan(layout, cu, world_size, r, s, causal, 0, window):
                if b.kind == "diag":
                    total += b.q_n * (b.q_n + 1) // 2
                elif b.mask is not None:
                    total += int(b.mask.sum())
                else:
                    total += b.q_n * b.k_n
        work.append(total)
    return work
