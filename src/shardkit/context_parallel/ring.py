"""Ring attention: KV blocks rotate around the ring of ``R`` ranks while each rank attends its own queries.

Forward, ``R`` steps: at step ``i`` rank ``r`` holds the KV block of rank ``(r - i) mod R``. The
exchange for step ``i + 1`` (send the block to ``r + 1``, receive from ``r - 1``, one packed
buffer for k and v, one ``batch_isend_irecv``) is posted *before* the step's attention is
computed, so communication overlaps compute. Partial outputs are merged with their log-sum-exp
(online softmax) in float32 (float64 for float64 inputs).

Causal masking works on whole chunks. Each rank's tokens are chunks of the global sequence
(zigzag: chunks ``r`` and ``2R - 1 - r`` of ``zigzag_chunk_sizes(S, 2R)``; contiguous: block ``r``
of the balanced split), identified by their global chunk index. For a (query chunk, key chunk)
pair: key chunk earlier -> fully visible; the same chunk -> diagonal (``is_causal``); later ->
fully masked and never computed. With zigzag every rank computes ``2R + 1`` of its ``4R`` pairs
(balanced work); with the contiguous layout rank ``r`` computes ``r + 1`` blocks.

Packed documents (``cu_seqlens``): each document is laid out zigzag on its own (the packed layout
of :func:`packed_split`) and the blocks of a step are planned from the document id and global
position of the local queries and the visiting keys (:mod:`._ring_plan`): pairs in different
documents are skipped, pairs within a document follow the chunk rule above, and tiles that
gather several short documents run with an explicit mask. The plan is cached per layout.

Backward (an explicit autograd Function, not autograd through the loop) replays the ring:
each block's gradients are recomputed from the saved local q, k, v, the output and the
log-sum-exp (no attention matrix or foreign KV block is kept between passes, so activation
memory stays ``O(S / R)``). dQ accumulates locally; dK/dV accumulate in a buffer that travels
with its KV block and reaches the block's owner after ``R`` hops. The KV block for step ``i + 1``
is posted before step ``i``'s blocks are recomputed (overlapped); the dK/dV buffer of the step is
waited for before its blocks add into it in place, so that a rank holds two dK/dV blocks, not
three (the peak-memory test bounds a rank at ``1/R + 0.15`` of one rank holding everything).
k and v (dK and dV) are sent as they are, without a packing copy. ``overlap=False`` waits for
every exchange as soon as it is posted: the baseline of the benchmark.

Source: Liu et al., "Ring Attention with Blockwise Transformers" (2023); the zigzag balance of
Megatron-LM context parallelism and Brandon et al., "Striped Attention" (2023).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch

from .._shapes import balanced_split_sizes
from ..comm._group import GroupInfo
from ..comm._validate import gather_sizes, maybe_agree
from ..errors import ShardkitError, ShardkitTypeError
from ._blocks import acc_dtype, block_backward, block_forward, merge
from ._checks import _validate
from ._dtensor import takes_dtensors
from ._options import variant
from ._ring_comm import _Ring, layout_sizes, ring_kv
from ._sizes import zigzag_chunk_sizes

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["ring_attention", "ring_chunks", "local_variant_attention"]

_OP = "ring_attention"
LAYOUTS = ("zigzag", "contiguous", "stripe")

#: With packed documents, consecutive pieces shorter than this many tokens share a block tile
#: (computed with a mask) instead of costing one kernel call per piece pair; see :mod:`._ring_plan`.
PACKED_MIN_TILE = 64


def ring_chunks(layout: str, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int, int]]:
    """``(global chunk index, local offset, length)`` of each chunk rank ``rank`` holds, in local order.

    Raises:
        ShardkitError: ``layout="stripe"`` (no chunks: rank ``r`` holds every ``R``-th token).
    """
    if layout == "stripe":
        raise ShardkitError("ring_chunks: the stripe layout has no chunks (rank r holds tokens r, r + R, ...)")
    if layout == "zigzag":
        c = zigzag_chunk_sizes(seq_len, world_size)
        second = 2 * world_size - 1 - rank
        return [(rank, 0, c[rank]), (second, c[rank], c[second])]
    return [(rank, 0, balanced_split_sizes(seq_len, world_size)[rank])]


class _RingAttention(torch.autograd.Function):
    """``(out, lse)`` with ``return_lse`` (lse not differentiable: its gradient is not taken), else ``out``."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float, softcap: float | None = None, return_lse: bool = False):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g, rep, acc = ring.g, q.shape[2] // k.shape[2], acc_dtype(q.dtype)
        out = q.new_zeros(*q.shape[:3], v.shape[3], dtype=acc)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kb, vb = k, v
        for step in range(g.size):
            pending = None
            if step < g.size - 1:  # post the next block's transfer before computing on this one
                pending = ring.post([kb, vb], ring.kv_like(ring.src(step + 1), k), "forward")
            for i, b in enumerate(ring.plans[step]):
                qs, ks = slice(b.q_off, b.q_off + b.q_n), slice(b.k_off, b.k_off + b.k_n)
                mask = ring.mask(step, i, b, q.device)
                o_b, l_b = block_forward(q[:, qs], kb[:, ks], vb[:, ks], b.kind == "diag", scale, rep, mask, softcap)
                merge(out[:, qs], lse[:, qs], o_b, l_b)
            ring.count("forward", len(ring.plans[step]))
            if pending is not None:
                kb, vb = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.softcap = ring, scale, softcap
        if not return_lse:
            return out
        lse_out = lse.clone()  # the saved lse stays the backward's own
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        g, rep, acc = ring.g, q.shape[2] // k.shape[2], acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kb, vb, grad_pending = k, v, None
        for step in range(g.size):
            src = ring.src(step)
            kv_pending = None
            if step < g.size - 1:  # the KV block is not changed by this step: send it ahead
                kv_pending = ring.post([kb, vb], ring.kv_like(ring.src(step + 1), k), "backward")
            # dK/dV of block ``src`` so far (the earlier ranks' share, zero at step 0); this rank's
            # blocks add into it in place. Waiting for it here, instead of computing into a fresh
            # buffer while it travels, keeps two dK/dV blocks per rank alive instead of three
            # (the memory bound of the tests); the KV transfer above still overlaps the compute.
            if grad_pending is None:
                dk, dv = (t.zero_() for t in ring.kv_like(src, k, acc))
            else:
                dk, dv = grad_pending.wait()
            grad_pending = None
            for i, b in enumerate(ring.plans[step]):
                qs, ks = slice(b.q_off, b.q_off + b.q_n), slice(b.k_off, b.k_off + b.k_n)
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, qs],
                    q[:, qs],
                    kb[:, ks],
                    vb[:, ks],
                    out[:, qs],
                    lse[:, qs],
                    b.kind == "diag",
                    scale,
                    rep,
                    mask=ring.mask(step, i, b, q.device),
                    softcap=ctx.softcap,
                )
                dq[:, qs] += dq_b
                dk[:, ks] += dk_b
                dv[:, ks] += dv_b
                del dq_b, dk_b, dv_b
            ring.count("backward", len(ring.plans[step]))
            if kv_pending is not None:
                kb, vb = kv_pending.wait()
            if g.size > 1:  # dK/dV of block ``src`` travel on with it
                grad_pending = ring.post([dk, dv], ring.kv_like(ring.src(step + 1), k, acc), "backward")
                del dk, dv
        if grad_pending is not None:  # after R hops the buffers of this rank's own block are home
            dk, dv = grad_pending.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def __getattr__(name: str):
    if name == "BLOCK_COUNTS":  # removed: a process-wide counter mutated inside the autograd Function
        raise AttributeError(
            "shardkit.context_parallel.ring.BLOCK_COUNTS was removed: pass ring_attention(..., "
            "block_counts=collections.Counter()) and read that counter"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@overload
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    scale: float | None = None,
    layout: str = "zigzag",
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    overlap: bool = True,
    block_counts: Counter | None = None,
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    scale: float | None = None,
    layout: str = "zigzag",
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    overlap: bool = True,
    block_counts: Counter | None = None,
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@takes_dtensors()
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool,
    scale: float | None = None,
    layout: str = "zigzag",
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    overlap: bool = True,
    block_counts: Counter | None = None,
    window: tuple[int, int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ring attention over a sequence sharded in ``layout``; the ring replayed in backward (dK/dV travel home).

    Args:
        q: ``[B, S_r, N, D]``: this rank's tokens in ``layout`` (zigzag: chunks ``r`` and
            ``2R - 1 - r`` of ``zigzag_chunk_sizes(S, 2R)``, as :func:`zigzag_split` gives;
            stripe: global tokens ``r, r + R, r + 2R, ...``, i.e. ``x[:, r::R]``;
            packed zigzag with ``cu_seqlens``: this rank's zigzag part of every document, in
            document order, as :func:`packed_split` gives; contiguous: block ``r`` of
            ``balanced_split_sizes(S, R)``, documents or not).
        k: ``[B, S_r, N_kv, D]`` with ``N % N_kv == 0`` (grouped-query attention: query head
            ``h`` uses KV head ``h // (N / N_kv)``; only ``N_kv`` heads travel the ring).
        v: ``[B, S_r, N_kv, Dv]``.
            q, k, v may instead all be DTensors ``Shard(1)`` over the group (global shapes):
            a DTensor comes back (:mod:`._dtensor`: layouts, placements, errors).
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the ring).
        causal: mask keys after each query's global position (within its document when packed).
        scale: softmax scale; None for ``1 / sqrt(D)``.
        layout: ``"zigzag"`` (load-balanced for causal attention), ``"contiguous"`` or
            ``"stripe"`` (Brandon et al., "Striped Attention" (2023): balanced too, one
            triangular block per step; one sequence, no window).
        seq_len: the global length ``S``; None means ``cu_seqlens[-1]`` when given, else it is
            learned: one small metadata all-gather of the local lengths (ledger phase
            ``"metadata"``), ``S`` their sum, checked against ``layout`` on every rank. Passing
            it (or ``cu_seqlens``) skips that collective.
        cu_seqlens: *global* cumulative document lengths ``[num_docs + 1]`` of a packed
            sequence (ints or a 1-D integer tensor, identical on every rank; zero-length
            documents allowed). Tokens attend only within their document; the block between
            the local queries and a visiting KV block is planned from the document id and
            position of both sides: hidden pairs are skipped, partly visible tiles run masked.
        overlap: post each exchange before computing on the current block (default). False
            waits for every exchange before computing (the baseline the overlap is measured
            against); results are identical.
        block_counts: a :class:`collections.Counter` the caller owns (tests, profiling): each
            local block computation adds 1 under ``"forward"`` and, when the backward runs,
            ``"backward"`` (skipped causal, cross-document or out-of-window blocks never count).
        window: ``(left, right)``: query ``i`` sees keys ``i - left <= j <= i + right`` of the
            global positions (``-1``: unbounded; ``right`` is 0 under ``causal``), flash-attn's
            ``window_size``. Chunk pairs entirely outside every query's window are skipped (no
            compute, :mod:`._ring_plan`); pairs entirely inside run unmasked on the fused
            kernels; only partly covered pairs run with an explicit mask block.
        sliding_window: Hugging Face's ``W`` (keys ``i - W < j <= i``): ``window=(W - 1, W - 1)``.
        softcap: Gemma 2's logit cap, ``softcap * tanh(scores / softcap)`` before the mask;
            0 or None is off. Every block then runs the math path (no fused kernel caps).
        return_lse: also return the log-sum-exp of every query row (not differentiable).

    Returns:
        ``[B, S_r, N, Dv]`` in ``q.dtype``: attention output for this rank's tokens, same layout;
        with ``return_lse``, ``(out, lse)`` with ``lse`` ``[B, S_r, N]`` (natural log, float32, or
        float64 for float64 inputs; the local token order of ``out``).

    Raises:
        ShardkitError: non-4-D inputs, q/k/v disagreeing on ``B``, ``S_r``, ``N_kv`` or ``D``,
            ``N`` not a multiple of ``N_kv``, bad ``scale``/``seq_len``/``layout``/``cu_seqlens``,
            or ``S_r`` not this rank's share of ``S`` (with ``seq_len``: a local check, agree
            first with the check mode when ranks may disagree; without: raised on every rank).
        ShardkitTypeError: non-tensor inputs, mixed or non-floating dtypes, bad ``group``, non-bool
            ``overlap``.

    Communication (the ledger's ``api="ring_attention"``, one ``batch_isend_irecv`` per
    exchange, recorded as one ``send`` and one ``recv``): forward ``R - 1`` of each (k and v
    together), backward ``2R - 1`` of each (``R - 1`` KV blocks, ``R`` dK/dV buffers in the
    accumulation dtype). Nothing for ``R = 1``. The same with ``cu_seqlens``: every block
    travels the whole ring, skipped or not.
    """

    def ring_args(g):
        if layout not in LAYOUTS:
            raise ShardkitError(f"{_OP}: layout must be one of {LAYOUTS}, got {layout!r} (group of {g.size})")
        if not isinstance(overlap, bool):
            raise ShardkitTypeError(f"{_OP}: overlap must be a bool, got {overlap!r}")
        if layout == "stripe" and (
            (cu_seqlens is not None and len(cu_seqlens) > 2)
            or variant(_OP, causal, window, sliding_window, softcap, return_lse).window is not None
        ):
            raise ShardkitError(
                f"{_OP}: the stripe layout takes one sequence without a window (no cu_seqlens with several "
                f"documents, no window); use layout='zigzag' (group of {g.size})"
            )

    options = dict(window=window, sliding_window=sliding_window, softcap=softcap, return_lse=return_lse)
    g, cu, seq_len, var, error = _validate(
        q, k, v, group, causal, scale, cu_seqlens, seq_len, op=_OP, extra=ring_args, options=options
    )
    if error is not None:
        maybe_agree(g, _OP, q, local_dim=1, error=error)  # the same error on every rank
    args = (
        q.shape[2],
        k.shape[2],
        q.shape[3],
        v.shape[3],
        int(causal),
        scale,
        seq_len,
        LAYOUTS.index(layout),
        cu,
        *var.agreed,
    )
    if seq_len is None:
        # Learned: one metadata all-gather (or the check mode's table); every rank then checks
        # the same table against the layout, so a wrong split is one error on every rank.
        sizes = gather_sizes(q, g, 1, _OP, maybe_agree(g, _OP, q, args, local_dim=1))
        seq_len = sum(sizes)
        expected = layout_sizes(layout, (0, seq_len), g.size)
        if sizes != expected:
            bad = [r for r in range(g.size) if sizes[r] != expected[r]]
            raise ShardkitError(
                f"{_OP}: the ranks hold {sizes} tokens (S = {seq_len}), "
                f"but the {layout} layout of S over {g.size} ranks "
                f"is {expected} (offending ranks {bad}); lay the sequence out with zigzag_split / the balanced split"
            )
        cu = (0, seq_len)
    else:
        cu = (0, seq_len) if cu is None else cu
        expected = layout_sizes(layout, cu, g.size)
        maybe_agree(g, _OP, q, args, local_dim=1, expected_local=expected[g.rank])
        if q.shape[1] != expected[g.rank]:
            what = f"{layout} layout of S = {seq_len}" + (f" ({len(cu) - 1} documents)" if len(cu) > 2 else "")
            raise ShardkitError(
                f"{_OP}: rank {g.rank} of {g.size} holds {q.shape[1]} tokens, but the {what} gives it "
                f"{expected[g.rank]} ({expected}); leave seq_len= out to learn S"
            )
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    shapes = (q.shape[0], k.shape[2], k.shape[3], v.shape[3])
    ring = _Ring(g, layout, cu, causal, overlap, shapes, block_counts, var.window, PACKED_MIN_TILE)
    return _RingAttention.apply(q, k, v, ring, scale, var.softcap, var.return_lse)


def local_variant_attention(q, k, v, *, causal: bool, scale, cu, kv_index, var):
    """One rank's attention with a window, softcap or lse: the blocks of a ring of one rank.

    ``q [B, S, n, D]``, ``k``/``v`` ``[B, S, n_kv, D | Dv]``, ``kv_index`` the local KV head of
    each query head (Ulysses' head plan). The same block plan, kernels and exact backward as
    :func:`ring_attention` (contiguous layout of ``cu``), without any communication, so Ulysses
    and ring agree on every variant. Returns ``(out [B, S, n, Dv], lse [B, S, n])``.
    """
    g = GroupInfo(cast(Any, None), 1, 0)  # no process group: a ring of one never posts
    cu = (0, q.shape[1]) if cu is None else cu
    k, v = ring_kv(k, kv_index), ring_kv(v, kv_index)
    shapes = (q.shape[0], k.shape[2], k.shape[3], v.shape[3])
    ring = _Ring(g, "contiguous", cu, causal, True, shapes, None, var.window, PACKED_MIN_TILE)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, ring, scale, var.softcap, True)
