"""Unified sequence parallelism (USP): Ulysses all-to-all inside, ring attention across.

The context-parallel mesh is 2-D, ``R`` ring ranks x ``U`` Ulysses ranks. The sequence is first
laid out zigzag over the ring dim (ring rank ``i`` owns part ``i``, ``zigzag_local_sizes(S, R)[i]``
tokens); each part is then split contiguously (balanced) over the Ulysses dim. An all-to-all
over the Ulysses dim turns ``[B, S_i / U, N, D]`` into ``[B, S_i, N / U, D]`` (the whole ring
part, a share of the heads), :func:`ring_attention` runs over the ring dim on those heads, and
a second all-to-all returns ``[B, S_i / U, N, Dv]``. Backward is the reverse all-to-alls around
the ring attention's own backward.

**Packed documents** (``cu_seqlens``, global cumulative lengths): ring part ``i`` is the packed
zigzag part of :func:`packed_split` over the ``R`` ring ranks (rank ``i``'s zigzag part of every
document, in document order, ``packed_local_sizes(cu, R)[i]`` tokens), and that part is split
contiguously (balanced) over the ``U`` Ulysses ranks, cutting through documents where it falls.
After the all-to-all each Ulysses rank holds the whole ring part, which is exactly what
:func:`ring_attention` with ``cu_seqlens`` takes; documents never attend across boundaries.
:func:`usp_indices` gives the global token indices of every rank (index the packed tensor with
them, and :func:`packed_positions`-style position ids with ``indices - doc_start``).

Source: Fang & Zhao, "USP: A Unified Sequence Parallelism Approach for Long Context Generative
AI" (2024).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

import torch

from .._shapes import balanced_split_sizes, split_offsets
from ..comm._group import resolve_group
from ..comm._validate import gather_ints, gather_sizes, maybe_agree_groups
from ..errors import ShardkitError, ShardkitTypeError
from ._checks import _validate
from ._dtensor import takes_dtensors
from ._ring_comm import ring_kv
from ._sizes import check_cu_seqlens, packed_indices, packed_local_sizes, ulysses_head_plan, zigzag_local_sizes
from .ring import ring_attention
from .ulysses import _scatter, _SequenceToHeads, lse_to_sequence

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["usp_attention", "usp_local_sizes", "usp_packed_local_sizes", "usp_indices"]

_OP = "usp_attention"


def usp_local_sizes(seq_len: int, ring_size: int, ulysses_size: int) -> list[list[int]]:
    """Tokens held by rank ``(i, j)`` of the ``R x U`` mesh, as ``sizes[i][j]``."""
    return [balanced_split_sizes(n, ulysses_size) for n in zigzag_local_sizes(seq_len, ring_size)]


def usp_packed_local_sizes(
    cu_seqlens: Sequence[int] | torch.Tensor, ring_size: int, ulysses_size: int
) -> list[list[int]]:
    """Tokens held by rank ``(i, j)`` of the ``R x U`` mesh for packed documents, as ``sizes[i][j]``."""
    return [balanced_split_sizes(n, ulysses_size) for n in packed_local_sizes(cu_seqlens, ring_size)]


def usp_indices(
    cu_seqlens: Sequence[int] | torch.Tensor,
    ring_size: int,
    ulysses_size: int,
    ring_rank: int,
    ulysses_rank: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global token indices (int64) held by rank ``(ring_rank, ulysses_rank)``, in local order.

    ``cu_seqlens`` as in :func:`usp_attention`; ``[0, S]`` for one unpacked sequence. Raises
    ShardkitError / ShardkitTypeError on malformed ``cu_seqlens`` or ranks.
    """
    cu = check_cu_seqlens(cu_seqlens, "usp_indices")
    part = packed_indices(cu, ring_size, ring_rank)
    sizes = usp_packed_local_sizes(cu, ring_size, ulysses_size)[ring_rank]
    if not 0 <= ulysses_rank < ulysses_size:
        raise ShardkitError(f"usp_indices: ulysses_rank must be in [0, {ulysses_size}), got {ulysses_rank}")
    off = split_offsets(sizes)[ulysses_rank]
    return part[off : off + sizes[ulysses_rank]].to(device)


def _submeshes(mesh, ring_dim: str, ulysses_dim: str):
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or mesh.ndim != 2 or set(names) != {ring_dim, ulysses_dim}:
        raise ShardkitTypeError(
            f"{_OP}: mesh must be a 2-D DeviceMesh with dims ({ring_dim!r}, {ulysses_dim!r}), got "
            f"{type(mesh).__name__} with dims {names}"
        )
    return resolve_group(mesh[ring_dim], _OP), resolve_group(mesh[ulysses_dim], _OP)


def _agree_both(g_uly, g_ring, q, args, expected, error):
    """Check mode: agree over the Ulysses dim, then over the ring dim
    (:func:`~shardkit.comm._validate.maybe_agree_groups`), so that every rank of the 2-D mesh
    has seen the same arguments before any data moves; returns the Ulysses blocks' sizes."""
    return maybe_agree_groups((g_uly, g_ring), _OP, q, args, error, local_dim=1, expected_local=expected)


@overload
def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    *,
    causal: bool,
    scale: float | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    ring_dim: str = "cp_ring",
    ulysses_dim: str = "cp_ulysses",
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    *,
    causal: bool,
    scale: float | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    ring_dim: str = "cp_ring",
    ulysses_dim: str = "cp_ulysses",
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@takes_dtensors(group_arg="mesh", usp=True)
def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    *,
    causal: bool,
    scale: float | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    ring_dim: str = "cp_ring",
    ulysses_dim: str = "cp_ulysses",
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-to-all over ``ulysses_dim``, ring attention over ``ring_dim``, all-to-all back; reversed in backward.

    Args:
        q: ``[B, S_ij, N, D]``: block ``j`` (balanced split over ``U``) of zigzag ring part ``i``,
            ``S_ij = usp_local_sizes(S, R, U)[i][j]``.
        k: ``[B, S_ij, N_kv, D]`` with ``N % N_kv == 0`` (grouped-query attention).
        v: ``[B, S_ij, N_kv, Dv]``.
            q, k, v may instead all be DTensors ``Shard(1)`` over the group (global shapes):
            a DTensor comes back (:mod:`._dtensor`: layouts, placements, errors).
        mesh: 2-D ``DeviceMesh`` with dims ``ring_dim`` (``R``) and ``ulysses_dim`` (``U``).
        causal: mask keys after each query's global position.
        scale: softmax scale; None for ``1 / sqrt(D)``.
        seq_len: global ``S``; None means ``cu_seqlens[-1]`` when given, else it is learned
            with one small metadata all-gather per mesh dim (ledger phase ``"metadata"``): the
            Ulysses blocks of a ring part may then be any contiguous split, and the ring parts
            must be the zigzag layout of their sum.
        cu_seqlens: global cumulative document lengths of a packed sequence (identical on every
            rank). Then ``S_ij = usp_packed_local_sizes(cu, R, U)[i][j]``: block ``j`` of ring
            part ``i`` of the packed zigzag layout (module docstring); tokens attend only within
            their document. :func:`usp_indices` gives each rank's global token indices.
        window: ``(left, right)`` over global positions, as in
            :func:`~shardkit.context_parallel.ring_attention`, which applies it over the ring
            dim (out-of-window chunk pairs skipped there).
        sliding_window: Hugging Face's ``W``: ``window=(W - 1, W - 1)``.
        softcap: Gemma 2's logit cap before the mask; 0 or None is off.
        return_lse: also return the log-sum-exp of every query row (not differentiable).

    Returns:
        ``[B, S_ij, N, Dv]`` in the input layout; with ``return_lse``, ``(out, lse)``, ``lse``
        ``[B, S_ij, N]`` (float32, or float64 for float64 inputs).

    Raises:
        ShardkitError: the checks of :func:`ring_attention` and :func:`ulysses_attention`;
            ``N < U``; ``S_ij`` not this rank's share of ``S``.
        ShardkitTypeError: ``mesh`` not a 2-D mesh with the two named dims; bad tensors.

    Communication: ``api="ulysses_attention"`` all-to-alls over the Ulysses dim (2 forward,
    2 backward; one more each way when ``Dv != D``) and ``api="ring_attention"`` send/recv
    over the ring dim (see :func:`ring_attention`); with ``return_lse`` one more all-to-all in
    forward over the Ulysses dim (the lse back to the sequence layout).
    """
    g_ring, g_uly = _submeshes(mesh, ring_dim, ulysses_dim)
    R, U = g_ring.size, g_uly.size

    def heads(g):
        if q.shape[2] < U:
            raise ShardkitError(f"{_OP}: {q.shape[2]} query heads cannot be split over {U} Ulysses ranks (need N >= U)")

    options = dict(window=window, sliding_window=sliding_window, softcap=softcap, return_lse=return_lse)
    _, cu, seq_len, var, error = _validate(
        q, k, v, mesh[ulysses_dim], causal, scale, cu_seqlens, seq_len, op=_OP, extra=heads, options=options
    )
    if error is not None:
        _agree_both(g_uly, g_ring, q, (), None, error)  # raises the same error on every rank
    n, n_kv, d, dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    args = (n, n_kv, d, dv, int(causal), scale, seq_len, cu, *var.agreed)
    if seq_len is None:
        # Learned, one metadata all-gather per mesh dim: the Ulysses blocks of this ring part
        # (any contiguous split), then the ring parts, which must be the zigzag layout of S.
        seq_sizes = gather_sizes(q, g_uly, 1, _OP, _agree_both(g_uly, g_ring, q, args, None, None))
        parts = gather_ints(sum(seq_sizes), g_ring, _OP, q.device)
        seq_len = sum(parts)
        expected = zigzag_local_sizes(seq_len, R)
        if parts != expected:
            raise ShardkitError(
                f"{_OP}: the ring parts of the {R}x{U} mesh hold {parts} tokens (S = {seq_len}), but the zigzag layout "
                f"of S over {R} ring ranks is {expected} (offending ring ranks "
                f"{[i for i in range(R) if parts[i] != expected[i]]})"
            )
    else:
        sizes = usp_local_sizes(seq_len, R, U) if cu is None else usp_packed_local_sizes(cu, R, U)
        seq_sizes = sizes[g_ring.rank]
        _agree_both(g_uly, g_ring, q, args, seq_sizes[g_uly.rank], None)
        if q.shape[1] != seq_sizes[g_uly.rank]:
            raise ShardkitError(
                f"{_OP}: rank ({g_ring.rank}, {g_uly.rank}) of the {R}x{U} mesh holds {q.shape[1]} tokens, "
                f"but S = {seq_len} "
                f"{'' if cu is None else f'({len(cu) - 1} documents) '}gives it {seq_sizes[g_uly.rank]} ({sizes}); "
                "leave seq_len= out to learn S"
            )
    plan = ulysses_head_plan(n, n_kv, U)
    named = {"q": q, "k": k, "v": v}
    if U == 1:
        moved = named
    elif dv == d:
        moved = _scatter(named, "qkv", g_uly, plan, n, n_kv, seq_sizes)
    else:
        moved = {
            **_scatter(named, "qk", g_uly, plan, n, n_kv, seq_sizes),
            **_scatter(named, "v", g_uly, plan, n, n_kv, seq_sizes),
        }
    idx = plan.kv_index[g_uly.rank]
    out = ring_attention(
        moved["q"],
        ring_kv(moved["k"], idx),
        ring_kv(moved["v"], idx),
        mesh[ring_dim],
        causal=causal,
        scale=scale,
        layout="zigzag",
        seq_len=seq_len,
        cu_seqlens=cu,
        window=var.window,
        softcap=var.softcap,
        return_lse=var.return_lse,
    )
    out, lse = out if var.return_lse else (out, None)
    if U > 1:
        out = _SequenceToHeads.apply(out, g_uly, seq_sizes, list(plan.q_sizes))
        lse = None if lse is None else lse_to_sequence(lse, g_uly, seq_sizes, list(plan.q_sizes))
    return out if lse is None else (out, lse)
