"""Ulysses attention: all-to-all from sequence shards to head shards, local attention, and back.

Each rank holds a contiguous block of the sequence, ``[B, S_r, N, D]`` with ``S_r`` from the
balanced split of ``S``. One all-to-all turns it into ``[B, S, N_r, D]`` (all tokens, this
rank's heads, balanced split of ``N``), attention runs locally over the whole sequence, and a
second all-to-all returns ``[B, S_r, N, Dv]``. Backward is the reverse all-to-alls; autograd
differentiates the local attention.

q, k and v travel in one all-to-all whenever they share the head dim ``D`` (``Dv == D``):
each rank packs, per destination, that destination's query heads and the KV heads they need.
With grouped-query attention the KV heads are not repeated to ``N`` first: a destination gets
the KV heads its query heads use (:func:`ulysses_head_plan`), duplicated only when a KV group
straddles a rank boundary, and the duplicate's gradients are summed back in backward.

Source: Jacobs et al., "DeepSpeed Ulysses" (2023); uneven sequence and head splits follow
MindSpeed-MM's unaligned all-to-all (balanced split sizes).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Literal, overload

import torch

from .._shapes import balanced_split_sizes
from ..comm import _c10d
from ..comm._group import GroupInfo
from ..comm._validate import gather_sizes, maybe_agree
from ..errors import ShardkitError
from ._attention import local_attention
from ._checks import _validate
from ._dtensor import takes_dtensors
from ._sizes import HeadPlan, ulysses_head_plan
from .ring import local_variant_attention

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["ulysses_attention"]

_OP = "ulysses_attention"


@functools.lru_cache(maxsize=64)
def _send_rows(b: int, s: int, n_total: int, heads: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """Rows of a ``[B * S_r * n_total, D]`` view laid out as the send buffer: destination-major,
    then ``(b, s)``, then that destination's heads. Cached: a pure function of the shapes."""
    if device.type != "cpu":
        return _send_rows(b, s, n_total, heads, torch.device("cpu")).to(device)
    base = (torch.arange(b * s, dtype=torch.int64) * n_total)[:, None]
    parts = [(base + torch.tensor(h, dtype=torch.int64)[None, :]).reshape(-1) for h in heads]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class _HeadsToSequence(torch.autograd.Function):
    """``[B, S_r, n_total, D]`` -> ``[B, S, h_rank, D]``: destination ``j`` receives the heads
    ``heads[j]`` (any list, repeats allowed). Backward: the reverse all-to-all, then the
    gradient rows are summed into the heads they came from."""

    @staticmethod
    def forward(ctx, x, g: GroupInfo, heads, seq_sizes):
        b, s_r, n_total, d = x.shape
        rows = _send_rows(b, s_r, n_total, heads, x.device)
        send = x.contiguous().view(-1, d).index_select(0, rows).view(-1)
        in_splits = [b * s_r * len(h) * d for h in heads]
        h_me = len(heads[g.rank])
        out_splits = [b * n * h_me * d for n in seq_sizes]
        recv = _c10d.all_to_all_flat(send, in_splits, out_splits, g, _OP, "forward", shape=x.shape)
        ctx.g, ctx.rows, ctx.in_splits, ctx.out_splits, ctx.seq_sizes, ctx.shape = (
            g,
            rows,
            in_splits,
            out_splits,
            seq_sizes,
            x.shape,
        )
        return _c10d._unpack(recv, [b, sum(seq_sizes), h_me, d], 1, seq_sizes)

    @staticmethod
    def backward(ctx, grad):
        g, d = ctx.g, ctx.shape[-1]
        send = _c10d._pack(grad.contiguous(), 1, ctx.seq_sizes)
        recv = _c10d.all_to_all_flat(send, ctx.out_splits, ctx.in_splits, g, _OP, "backward")
        out = grad.new_zeros(math.prod(ctx.shape[:-1]), d)
        out.index_add_(0, ctx.rows, recv.view(-1, d))  # duplicated KV heads: gradients summed
        return out.view(ctx.shape), None, None, None


class _SequenceToHeads(torch.autograd.Function):
    """``[B, S, N_r, Dv]`` -> ``[B, S_r, N, Dv]``; backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, g: GroupInfo, seq_sizes, head_sizes):
        ctx.g, ctx.seq_sizes, ctx.head_sizes = g, seq_sizes, head_sizes
        return _c10d.all_to_all(x, g, 1, 2, seq_sizes, head_sizes, _OP, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _c10d.all_to_all(grad, ctx.g, 2, 1, ctx.head_sizes, ctx.seq_sizes, _OP, "backward"), None, None, None


def _destination_heads(plan: HeadPlan, num_heads: int, num_kv: int, parts: str) -> tuple[tuple[int, ...], ...]:
    """Per destination rank, the heads of ``cat(parts, dim=2)`` it receives.

    ``parts`` names the stacked tensors in order: ``q`` (``N`` heads) or ``k``/``v`` (``N_kv``).
    """
    out = []
    offs, q0 = {}, 0
    for p in parts:
        offs[p] = q0
        q0 += num_heads if p == "q" else num_kv
    q_start = 0
    for n_q, (lo, hi) in zip(plan.q_sizes, plan.kv_ranges):
        heads = []
        for p in parts:
            rng = range(q_start, q_start + n_q) if p == "q" else range(lo, hi)
            heads += [offs[p] + h for h in rng]
        out.append(tuple(heads))
        q_start += n_q
    return tuple(out)


def _scatter(tensors: dict, parts: str, g: GroupInfo, plan: HeadPlan, n: int, n_kv: int, seq_sizes) -> dict:
    """Move the named tensors to the head layout in one all-to-all; returns them by name."""
    stack = torch.cat([tensors[p] for p in parts], dim=2) if len(parts) > 1 else tensors[parts[0]]
    moved = _HeadsToSequence.apply(stack, g, _destination_heads(plan, n, n_kv, parts), seq_sizes)
    out, at = {}, 0
    for p in parts:
        width = plan.q_sizes[g.rank] if p == "q" else plan.kv_sizes[g.rank]
        out[p] = moved.narrow(2, at, width)
        at += width
    return out


@overload
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    scale: float | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    scale: float | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@takes_dtensors()
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    scale: float | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-to-all to head shards, local attention over the whole sequence, all-to-all back.

    Backward runs the reverse all-to-alls.

    Args:
        q: ``[B, S_r, N, D]``, this rank's block of the contiguous balanced split of the sequence
            (rank ``r`` holds ``balanced_split_sizes(S, R)[r]`` tokens, zero allowed).
        k: ``[B, S_r, N_kv, D]`` with ``N % N_kv == 0`` (grouped-query attention; query head
            ``h`` uses KV head ``h // (N / N_kv)``).
        v: ``[B, S_r, N_kv, Dv]``.
            q, k, v may instead all be DTensors ``Shard(1)`` over the group (global shapes):
            a DTensor comes back (:mod:`._dtensor`: layouts, placements, errors).
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the Ulysses group).
        causal: mask keys after each query's position (within its document when packed).
        scale: softmax scale; None for ``1 / sqrt(D)``.
        cu_seqlens: global cumulative document lengths ``[num_docs + 1]`` of a packed sequence
            (ints or a 1-D integer tensor, identical on every rank); tokens attend only within
            their document. Fixes ``S = cu_seqlens[-1]``.
        seq_len: the global length ``S``, whose balanced split the ranks hold (no metadata
            traffic). None means ``cu_seqlens[-1]`` when given; else the ranks' lengths are
            learned with one small metadata all-gather (ledger phase ``"metadata"``) and any
            contiguous split works (uneven, zero-size blocks).
        window: ``(left, right)`` over global positions, flash-attn's ``window_size`` (see
            :func:`~shardkit.context_parallel.ring_attention`).
        sliding_window: Hugging Face's ``W`` (keys ``i - W < j <= i``): ``window=(W - 1, W - 1)``.
        softcap: Gemma 2's ``softcap * tanh(scores / softcap)`` before the mask; 0 or None is off.
        return_lse: also return the log-sum-exp of every query row (not differentiable). With
            any of the last four the local attention runs ring attention's blocks on one rank
            (:func:`~shardkit.context_parallel.ring.local_variant_attention`: fused kernels, with
            a window mask where a block is partly covered, the math path with a softcap).

    Returns:
        ``[B, S_r, N, Dv]``: attention output for this rank's tokens; with ``return_lse``,
        ``(out, lse)``, ``lse`` ``[B, S_r, N]`` (float32, or float64 for float64 inputs).

    Raises:
        ShardkitError: non-4-D inputs; q, k, v disagreeing on ``B``, ``S_r``, ``N_kv`` or ``D``;
            ``N`` not a multiple of ``N_kv``; bad ``scale``/``seq_len``/``cu_seqlens``; with
            ``seq_len`` or ``cu_seqlens``, ``S_r`` not this rank's balanced block of ``S`` (a
            local check: agree first with the check mode when ranks may disagree).
        ShardkitTypeError: non-tensor inputs, mixed or non-floating dtypes, bad ``group``.
        RankMismatchError: (check mode) ranks disagree on shapes, dtype or arguments.

    Communication (the ledger's ``api="ulysses_attention"``): forward 2 ``all_to_all_single``
    (q, k, v together; output back), backward 2; one more each way when ``Dv != D``; one more in
    forward with ``return_lse`` (the lse back to the sequence layout).
    """
    options = dict(window=window, sliding_window=sliding_window, softcap=softcap, return_lse=return_lse)
    g, cu, seq_len, var, error = _validate(q, k, v, group, causal, scale, cu_seqlens, seq_len, options=options)
    if error is not None:
        maybe_agree(g, _OP, q, local_dim=1, error=error)  # the same error on every rank
    n, n_kv, d, dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    args = (n, n_kv, d, dv, int(causal), scale, seq_len, cu, *var.agreed)
    if seq_len is None:
        # Learned: one metadata all-gather (or the check mode's table). Any contiguous split
        # works, since the all-to-all concatenates the blocks in rank order.
        seq_sizes = gather_sizes(q, g, 1, _OP, maybe_agree(g, _OP, q, args, local_dim=1))
        seq_len = sum(seq_sizes)
    else:
        seq_sizes = balanced_split_sizes(seq_len, g.size)
        maybe_agree(g, _OP, q, args, local_dim=1, expected_local=seq_sizes[g.rank])
        if q.shape[1] != seq_sizes[g.rank]:
            raise ShardkitError(
                f"{_OP}: rank {g.rank} of {g.size} holds {q.shape[1]} tokens, but the balanced split of S = {seq_len} "
                f"gives it {seq_sizes[g.rank]} ({seq_sizes}); leave seq_len= out to use any split"
            )
    plan = ulysses_head_plan(n, n_kv, g.size)
    scale = None if scale is None else float(scale)
    if g.size == 1 and var.plain and not var.return_lse:
        return local_attention(q, k, v, causal=causal, scale=scale, cu_seqlens=cu, kv_index=plan.kv_index[0])
    if g.size == 1:
        out, lse = local_variant_attention(
            q, k, v, causal=causal, scale=scale, cu=cu, kv_index=plan.kv_index[0], var=var
        )
        return (out, lse) if var.return_lse else out
    named = {"q": q, "k": k, "v": v}
    if dv == d:
        moved = _scatter(named, "qkv", g, plan, n, n_kv, seq_sizes)
    else:  # v cannot share the buffer's row width: a second all-to-all for it
        moved = {
            **_scatter(named, "qk", g, plan, n, n_kv, seq_sizes),
            **_scatter(named, "v", g, plan, n, n_kv, seq_sizes),
        }
    idx = plan.kv_index[g.rank]
    if var.plain and not var.return_lse:
        out = local_attention(
            moved["q"], moved["k"], moved["v"], causal=causal, scale=scale, cu_seqlens=cu, kv_index=idx
        )
        return _SequenceToHeads.apply(out, g, seq_sizes, list(plan.q_sizes))
    out, lse = local_variant_attention(
        moved["q"], moved["k"], moved["v"], causal=causal, scale=scale, cu=cu or (0, seq_len), kv_index=idx, var=var
    )
    out = _SequenceToHeads.apply(out, g, seq_sizes, list(plan.q_sizes))
    return (out, lse_to_sequence(lse, g, seq_sizes, list(plan.q_sizes))) if var.return_lse else out


def lse_to_sequence(lse: torch.Tensor, g: GroupInfo, seq_sizes, head_sizes) -> torch.Tensor:
    """``lse [B, S, N_r]`` (this rank's heads, every token) -> ``[B, S_r, N]``: one all-to-all,
    forward only (the lse is not differentiable)."""
    if g.size == 1:
        return lse
    moved = _c10d.all_to_all(lse.unsqueeze(-1).contiguous(), g, 1, 2, seq_sizes, head_sizes, _OP, "forward")
    return moved.squeeze(-1)
