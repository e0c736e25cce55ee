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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._shapes import balanced_split_sizes
from ..comm import ledger
from ..comm._compat import p2p_op
from ..comm._group import GroupInfo
from ..comm._validate import gather_sizes, maybe_agree
from ..errors import ShardkitError, ShardkitTypeError
from ._blocks import acc_dtype, block_backward, block_forward, merge
from ._ring_plan import block_plan
from ._sizes import packed_local_sizes, zigzag_chunk_sizes
from .ulysses import _validate

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["ring_attention", "ring_chunks"]

_OP = "ring_attention"
LAYOUTS = ("zigzag", "contiguous")

#: With packed documents, consecutive pieces shorter than this many tokens share a block tile
#: (computed with a mask) instead of costing one kernel call per piece pair; see :mod:`._ring_plan`.
PACKED_MIN_TILE = 64


def ring_chunks(layout: str, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int, int]]:
    """``(global chunk index, local offset, length)`` of each chunk rank ``rank`` holds, in local order."""
    if layout == "zigzag":
        c = zigzag_chunk_sizes(seq_len, world_size)
        second = 2 * world_size - 1 - rank
        return [(rank, 0, c[rank]), (second, c[rank], c[second])]
    return [(rank, 0, balanced_split_sizes(seq_len, world_size)[rank])]


def _layout_sizes(layout: str, cu: tuple[int, ...], world_size: int) -> list[int]:
    """Tokens of every rank in ``layout`` (packed zigzag with several documents)."""
    return packed_local_sizes(cu, world_size) if layout == "zigzag" else balanced_split_sizes(cu[-1], world_size)


class _Ring:
    """The ring neighbours, per-rank block sizes and block plans of one call."""

    def __init__(
        self, g: GroupInfo, layout: str, cu: tuple[int, ...], causal: bool, overlap: bool, shapes, counts=None
    ):
        self.g, self.layout, self.overlap, self.counts = g, layout, overlap, counts
        self.nxt, self.prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        self.sizes = _layout_sizes(layout, cu, g.size)
        self.shapes = shapes  # (B, N_kv, D, Dv)
        self.plans = [
            block_plan(layout, cu, g.size, g.rank, self.src(i), causal, PACKED_MIN_TILE) for i in range(g.size)
        ]
        self._masks: dict = {}

    def src(self, step: int) -> int:
        return (self.g.rank - step) % self.g.size

    def count(self, phase: str, blocks: int) -> None:
        """Add ``blocks`` computed blocks of ``phase`` to the caller's counter, if it passed one."""
        if self.counts is not None:
            self.counts[phase] += blocks

    def tokens(self, rank: int) -> int:
        return self.sizes[rank]

    def kv_like(self, rank: int, k: torch.Tensor, dtype=None):
        """Empty k and v blocks of rank ``rank`` (receive buffers)."""
        b, n_kv, d, dv = self.shapes
        s, dtype = self.tokens(rank), k.dtype if dtype is None else dtype
        return [k.new_empty(b, s, n_kv, d, dtype=dtype), k.new_empty(b, s, n_kv, dv, dtype=dtype)]

    def mask(self, step: int, i: int, block, device):
        """Block ``i``'s mask of step ``step`` on ``device``, moved once per call (forward and backward)."""
        if block.mask is None or device.type == "cpu":
            return block.mask
        key = (step, i)
        if key not in self._masks:
            self._masks[key] = block.mask.to(device)
        return self._masks[key]

    def post(self, sends: list, recvs: list, phase: str) -> _Pending:
        """Send ``sends`` to the next rank and receive ``recvs`` from the previous one, in place.

        k and v (or dK and dV) travel as they are, without a packing copy, in one
        ``batch_isend_irecv`` per exchange. With ``R = 2`` both peers are the same rank, and
        every rank posts its messages in the same order (FIFO matching, as NCCL requires).
        Without ``overlap`` the exchange is waited for at once (the no-overlap baseline).
        """
        ops = [p2p_op(True, t, self.g.pg, self.nxt) for t in sends] + [
            p2p_op(False, t, self.g.pg, self.prv) for t in recvs
        ]
        ledger.record(
            "send",
            _OP,
            phase,
            self.g.size,
            sum(t.nbytes for t in sends),
            0,
            pg=self.g.pg,
            shape=sends[0].shape,
            peer=self.nxt,
            dtype=sends[0].dtype,
        )
        ledger.record(
            "recv",
            _OP,
            phase,
            self.g.size,
            0,
            sum(t.nbytes for t in recvs),
            pg=self.g.pg,
            shape=recvs[0].shape,
            peer=self.prv,
            dtype=recvs[0].dtype,
        )
        works = dist.batch_isend_irecv(ops)
        pending = _Pending(works, recvs, sends)
        if not self.overlap:
            pending.wait()
        return pending


class _Pending:
    """An exchange in flight; keeps the send buffers alive until waited."""

    def __init__(self, works, recvs, sends):
        self.works, self.recvs, self.sends = works, recvs, sends

    def wait(self):
        for w in self.works or ():
            w.wait()
        self.works, self.sends = None, None
        return self.recvs


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float):
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
                o_b, l_b = block_forward(
                    q[:, qs], kb[:, ks], vb[:, ks], b.kind == "diag", scale, rep, mask=ring.mask(step, i, b, q.device)
                )
                merge(out[:, qs], lse[:, qs], o_b, l_b)
            ring.count("forward", len(ring.plans[step]))
            if pending is not None:
                kb, vb = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
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
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def __getattr__(name: str):
    if name == "BLOCK_COUNTS":  # removed: a process-wide counter mutated inside the autograd Function
        raise AttributeError(
            "shardkit.context_parallel.ring.BLOCK_COUNTS was removed: pass ring_attention(..., "
            "block_counts=collections.Counter()) and read that counter"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
) -> torch.Tensor:
    """Ring attention over a sequence sharded in ``layout``; the ring replayed in backward (dK/dV travel home).

    Args:
        q: ``[B, S_r, N, D]``: this rank's tokens in ``layout`` (zigzag: chunks ``r`` and
            ``2R - 1 - r`` of ``zigzag_chunk_sizes(S, 2R)``, as :func:`zigzag_split` gives;
            packed zigzag with ``cu_seqlens``: this rank's zigzag part of every document, in
            document order, as :func:`packed_split` gives; contiguous: block ``r`` of
            ``balanced_split_sizes(S, R)``, documents or not).
        k: ``[B, S_r, N_kv, D]`` with ``N % N_kv == 0`` (grouped-query attention: query head
            ``h`` uses KV head ``h // (N / N_kv)``; only ``N_kv`` heads travel the ring).
        v: ``[B, S_r, N_kv, Dv]``.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the ring).
        causal: mask keys after each query's global position (within its document when packed).
        scale: softmax scale; None for ``1 / sqrt(D)``.
        layout: ``"zigzag"`` (load-balanced for causal attention) or ``"contiguous"``.
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
            ``"backward"`` (skipped causal or cross-document blocks never count).

    Returns:
        ``[B, S_r, N, Dv]`` in ``q.dtype``: attention output for this rank's tokens, same layout.

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

    g, cu, seq_len, error = _validate(q, k, v, group, causal, scale, cu_seqlens, seq_len, op=_OP, extra=ring_args)
    if error is not None:
        maybe_agree(g, _OP, q, local_dim=1, error=error)  # the same error on every rank
    args = (q.shape[2], k.shape[2], q.shape[3], v.shape[3], int(causal), scale, seq_len, LAYOUTS.index(layout), cu)
    if seq_len is None:
        # Learned: one metadata all-gather (or the check mode's table); every rank then checks
        # the same table against the layout, so a wrong split is one error on every rank.
        sizes = gather_sizes(q, g, 1, _OP, maybe_agree(g, _OP, q, args, local_dim=1))
        seq_len = sum(sizes)
        expected = _layout_sizes(layout, (0, seq_len), g.size)
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
        expected = _layout_sizes(layout, cu, g.size)
        maybe_agree(g, _OP, q, args, local_dim=1, expected_local=expected[g.rank])
        if q.shape[1] != expected[g.rank]:
            what = f"{layout} layout of S = {seq_len}" + (f" ({len(cu) - 1} documents)" if len(cu) > 2 else "")
            raise ShardkitError(
                f"{_OP}: rank {g.rank} of {g.size} holds {q.shape[1]} tokens, but the {what} gives it "
                f"{expected[g.rank]} ({expected}); leave seq_len= out to learn S"
            )
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    ring = _Ring(g, layout, cu, causal, overlap, (q.shape[0], k.shape[2], k.shape[3], v.shape[3]), block_counts)
    return _RingAttention.apply(q, k, v, ring, scale)
