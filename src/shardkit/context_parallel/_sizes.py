"""Pure layout arithmetic of context parallelism (tier 1: no process group).

**Zigzag (load-balanced causal) layout.** The sequence of ``S`` tokens is cut into ``2R`` chunks
and rank ``r`` holds chunk ``r`` followed by chunk ``2R - 1 - r``. Under a causal mask the early
chunks are cheap and the late ones expensive, so pairing them gives every rank the same
attention work. Source: the load-balanced context parallelism of Megatron-LM and of zigzag ring
attention (Brandon et al., "Striped Attention", 2023; zhuzilin/ring-flash-attention).

**Uneven lengths.** The ``2R`` chunk sizes are ``balanced_split_sizes(S, 2R)`` (the first
``S % 2R`` chunks get one extra token), whatever ``S`` is: balancing is never switched off.
Rank ``r`` then holds ``chunks[r] + chunks[2R - 1 - r]`` tokens, and these loads differ by at
most one token across ranks (the extra tokens of the first ``R`` chunks go to distinct ranks,
those of the last ``R`` chunks pair with them in reverse). ``S < 2R`` gives zero-size chunks.

**Packed sequences.** ``cu_seqlens`` (``[0, L_0, L_0 + L_1, ...]``, ``num_docs + 1`` ints)
describes documents packed along the sequence. Each document is laid out zigzag on its own and
a rank's local tensor is the concatenation of its parts of every document, in document order.
The local ``cu_seqlens`` keeps one entry per document (zero-length local parts included), so
document ``d`` is local document ``d`` on every rank. Per document, loads differ by at most
one token; over ``num_docs`` documents by at most ``num_docs``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._shapes import balanced_split_sizes, split_offsets
from ..errors import ShardkitError, ShardkitTypeError

__all__ = [
    "zigzag_chunk_sizes",
    "zigzag_local_sizes",
    "zigzag_positions",
    "check_cu_seqlens",
    "packed_local_sizes",
    "packed_local_cu_seqlens",
    "packed_indices",
    "packed_positions",
    "HeadPlan",
    "ulysses_head_plan",
]


def _check_world(world_size: int, rank: int | None, op: str) -> None:
    for name, v in (("world_size", world_size), ("rank", rank)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ShardkitTypeError(f"{op}: {name} must be an int, got {v!r}")
    if world_size < 1:
        raise ShardkitError(f"{op}: world_size must be >= 1, got {world_size}")
    if rank is not None and not 0 <= rank < world_size:
        raise ShardkitError(f"{op}: rank must be in [0, {world_size}), got {rank}")


def zigzag_chunk_sizes(seq_len: int, world_size: int) -> list[int]:
    """The ``2R`` zigzag chunk sizes of a sequence of ``seq_len`` tokens: ``balanced_split_sizes(S, 2R)``."""
    _check_world(world_size, None, "zigzag_chunk_sizes")
    return balanced_split_sizes(seq_len, 2 * world_size)


def zigzag_local_sizes(seq_len: int, world_size: int) -> list[int]:
    """Tokens held by each rank in the zigzag layout: ``chunks[r] + chunks[2R - 1 - r]``."""
    c = zigzag_chunk_sizes(seq_len, world_size)
    return [c[r] + c[2 * world_size - 1 - r] for r in range(world_size)]


def _zigzag_ranges(start: int, length: int, world_size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(begin, end)`` of the two chunks rank ``rank`` holds of a document at ``start``."""
    sizes = balanced_split_sizes(length, 2 * world_size)
    offs = split_offsets(sizes)
    first, second = rank, 2 * world_size - 1 - rank
    return (
        (start + offs[first], start + offs[first] + sizes[first]),
        (start + offs[second], start + offs[second] + sizes[second]),
    )


def zigzag_positions(
    seq_len: int, world_size: int, rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global token indices of rank ``rank``'s zigzag part, in local order (int64 ``[S_r]``).

    Example: ``zigzag_positions(8, 2, 0) == [0, 1, 6, 7]`` and ``zigzag_positions(8, 2, 1) == [2, 3, 4, 5]``.
    These are the position ids (e.g. for rotary embeddings) of the local tokens.
    """
    _check_world(world_size, rank, "zigzag_positions")
    return packed_indices((0, seq_len), world_size, rank, device)


def check_cu_seqlens(cu_seqlens, op: str, total: int | None = None) -> tuple[int, ...]:
    """Validate cumulative document lengths and return them as a tuple of ints.

    Args:
        cu_seqlens: ``[num_docs + 1]`` ints (a sequence or a 1-D integer tensor), starting at 0,
            non-decreasing (zero-length documents allowed).
        op: operation name for messages.
        total: the packed length the last entry must equal, or None.

    Raises:
        ShardkitTypeError: not a sequence / 1-D integer tensor of ints.
        ShardkitError: empty, not starting at 0, decreasing, or not ending at ``total``.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if (
            cu_seqlens.dim() != 1
            or cu_seqlens.is_floating_point()
            or cu_seqlens.is_complex()
            or cu_seqlens.dtype == torch.bool
        ):
            raise ShardkitTypeError(
                f"{op}: cu_seqlens must be a 1-D integer tensor, "
                f"got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        values = tuple(int(v) for v in cu_seqlens.tolist())
    elif (
        isinstance(cu_seqlens, Sequence)
        and not isinstance(cu_seqlens, (str, bytes))
        and all(isinstance(v, int) and not isinstance(v, bool) for v in cu_seqlens)
    ):
        values = tuple(cu_seqlens)
    else:
        raise ShardkitTypeError(
            f"{op}: cu_seqlens must be a sequence of ints or a 1-D integer tensor, got {cu_seqlens!r}"
        )
    if not values or values[0] != 0:
        raise ShardkitError(f"{op}: cu_seqlens must start with 0 (num_docs + 1 entries), got {list(values)[:8]}")
    bad = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if bad:
        raise ShardkitError(
            f"{op}: cu_seqlens must be non-decreasing, "
            f"but entry {bad[0]} ({values[bad[0]]}) < entry {bad[0] - 1} ({values[bad[0] - 1]})"
        )
    if total is not None and values[-1] != total:
        raise ShardkitError(f"{op}: cu_seqlens ends at {values[-1]} but the sequence dim has {total} tokens")
    return values


def _doc_lengths(cu: tuple[int, ...]) -> list[int]:
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def packed_local_sizes(cu_seqlens: Sequence[int] | torch.Tensor, world_size: int) -> list[int]:
    """Tokens held by each rank when every document of ``cu_seqlens`` is laid out zigzag."""
    _check_world(world_size, None, "packed_local_sizes")
    cu = check_cu_seqlens(cu_seqlens, "packed_local_sizes")
    out = [0] * world_size
    for length in _doc_lengths(cu):
        for r, n in enumerate(zigzag_local_sizes(length, world_size)):
            out[r] += n
    return out


def packed_local_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor, world_size: int, rank: int) -> list[int]:
    """``cu_seqlens`` of rank ``rank``'s local tensor (same number of documents, some maybe empty)."""
    _check_world(world_size, rank, "packed_local_cu_seqlens")
    cu = check_cu_seqlens(cu_seqlens, "packed_local_cu_seqlens")
    out = [0]
    for length in _doc_lengths(cu):
        out.append(out[-1] + zigzag_local_sizes(length, world_size)[rank])
    return out


def packed_indices(
    cu_seqlens: Sequence[int] | torch.Tensor, world_size: int, rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Indices into the packed (global) sequence of rank ``rank``'s local tokens (int64)."""
    _check_world(world_size, rank, "packed_indices")
    cu = check_cu_seqlens(cu_seqlens, "packed_indices")
    return _order(cu, world_size, torch.device("cpu")).local(rank).to(device)


def packed_positions(
    cu_seqlens: Sequence[int] | torch.Tensor, world_size: int, rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Position of each local token within its own document (int64): position ids for packed data."""
    _check_world(world_size, rank, "packed_positions")
    cu = check_cu_seqlens(cu_seqlens, "packed_positions")
    starts = torch.tensor(cu[:-1], dtype=torch.int64)
    local_lengths = torch.tensor(_doc_lengths(tuple(packed_local_cu_seqlens(cu, world_size, rank))), dtype=torch.int64)
    doc_start = torch.repeat_interleave(starts, local_lengths)
    return (packed_indices(cu, world_size, rank) - doc_start).to(device)


@dataclass(frozen=True)
class _Order:
    """The zigzag permutation of a packed sequence.

    ``perm[k]`` is the global index of the k-th token of the rank-order concatenation (rank 0's
    local tokens, then rank 1's, ...); ``inverse`` maps a global index back to that position.
    """

    perm: torch.Tensor
    inverse: torch.Tensor
    sizes: tuple[int, ...]

    def local(self, rank: int) -> torch.Tensor:
        off = sum(self.sizes[:rank])
        return self.perm[off : off + self.sizes[rank]]


def _layout_ranges(cu: tuple[int, ...], world_size: int, rank: int, layout: str):
    """``(begin, end)`` global ranges of rank ``rank`` in ring ``layout``, in local order: zigzag
    per document, or one balanced block (contiguous: Llama 3's slice of packed documents)."""
    if layout == "contiguous":
        sizes = balanced_split_sizes(cu[-1], world_size)
        return [(sum(sizes[:rank]), sum(sizes[: rank + 1]))]
    return [x for d in range(len(cu) - 1) for x in _zigzag_ranges(cu[d], cu[d + 1] - cu[d], world_size, rank)]


@functools.lru_cache(maxsize=64)
def _order(cu: tuple[int, ...], world_size: int, device: torch.device, layout: str = "zigzag") -> _Order:
    """Cached per layout: a pure function of the documents, reused every training step."""
    if device.type != "cpu":
        cpu = _order(cu, world_size, torch.device("cpu"), layout)
        return _Order(cpu.perm.to(device), cpu.inverse.to(device), cpu.sizes)
    parts, sizes = [], []
    for r in range(world_size):
        if layout == "stripe":  # every R-th token (one sequence)
            parts.append(torch.arange(r, cu[-1], world_size, dtype=torch.int64))
            sizes.append(parts[-1].numel())
            continue
        n = 0
        for begin, end in _layout_ranges(cu, world_size, r, layout):
            if end > begin:
                parts.append(torch.arange(begin, end, dtype=torch.int64))
                n += end - begin
        sizes.append(n)
    perm = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), dtype=torch.int64)
    return _Order(perm, inverse, tuple(sizes))


@dataclass(frozen=True)
class HeadPlan:
    """Which attention heads each rank owns after the Ulysses all-to-all.

    Attributes:
        q_sizes: query heads per rank, ``balanced_split_sizes(N, R)``.
        kv_ranges: ``(lo, hi)`` per rank: the KV heads its query heads need (GQA group of query
            head ``h`` is ``h // (N / N_kv)``); empty (``lo == hi``) for a rank without heads.
        kv_index: per rank, the local KV head of each local query head.
    """

    q_sizes: tuple[int, ...]
    kv_ranges: tuple[tuple[int, int], ...]
    kv_index: tuple[tuple[int, ...], ...]

    @property
    def kv_sizes(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.kv_ranges)


@functools.lru_cache(maxsize=64)
def ulysses_head_plan(num_heads: int, num_kv_heads: int, world_size: int) -> HeadPlan:
    """Split ``N`` query heads and their ``N_kv`` KV heads (GQA) over ``R`` ranks.

    Query heads follow the balanced split. Each rank receives exactly the KV heads its query
    heads use: a KV head is sent to two ranks only when its query group straddles a rank
    boundary, so at most ``R - 1`` heads are duplicated (none when ``N_kv % R == 0``), against
    ``N - N_kv`` extra heads for repeating KV to ``N`` heads before the all-to-all.

    Raises:
        ShardkitError: ``N < 1``, ``N_kv < 1`` or ``N % N_kv != 0``.
    """
    op = "ulysses_head_plan"
    _check_world(world_size, None, op)
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ShardkitError(
            f"{op}: the number of query heads ({num_heads}) must be a positive multiple "
            f"of the number of KV heads ({num_kv_heads})"
        )
    group = num_heads // num_kv_heads
    q_sizes = balanced_split_sizes(num_heads, world_size)
    ranges, index = [], []
    for q0, n in zip(split_offsets(q_sizes), q_sizes):
        lo, hi = (q0 // group, (q0 + n - 1) // group + 1) if n else (0, 0)
        ranges.append((lo, hi))
        index.append(tuple((q0 + i) // group - lo for i in range(n)))
    return HeadPlan(tuple(q_sizes), tuple(ranges), tuple(index))


def document_positions(s: int, cu: tuple[int, ...] | None) -> torch.Tensor:
    """``[S]`` positions ``0..S-1`` on the host, restarting at 0 in every document of ``cu``."""
    pos = torch.arange(s)
    for a, b in zip((cu or ())[:-1], (cu or ())[1:]):
        pos[a:b] -= a
    return pos
