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

Backward (an explicit autograd Function, not autograd through the loop) replays the ring:
each block's gradients are recomputed from the saved local q, k, v, the output and the
log-sum-exp (no attention matrix or foreign KV block is kept between passes, so activation
memory stays ``O(S / R)``). dQ accumulates locally; dK/dV accumulate in a buffer that travels
with its KV block and reaches the block's owner after ``R`` hops. Both transfers overlap compute:
the KV block for step ``i + 1`` is posted before step ``i``'s blocks are recomputed, and a rank
computes its share of a block's dK/dV into a fresh buffer while the earlier ranks' share is
still in flight, then adds the two and posts the sum on.

Source: Liu et al., "Ring Attention with Blockwise Transformers" (2023); the zigzag balance of
Megatron-LM context parallelism and Brandon et al., "Striped Attention" (2023).
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist

from .._shapes import balanced_split_sizes
from ..comm import ledger
from ..comm._compat import p2p_op
from ..comm._group import GroupInfo
from ..comm._validate import maybe_agree
from ..errors import ShardkitError
from ._blocks import acc_dtype, block_backward, block_forward, merge
from ._sizes import zigzag_chunk_sizes
from .ulysses import _validate

__all__ = ["ring_attention", "ring_chunks"]

_OP = "ring_attention"
LAYOUTS = ("zigzag", "contiguous")

#: Local block computations on this process, by phase (``"forward"``/``"backward"``); for tests
#: and profiling (skipped causal blocks never count).
BLOCK_COUNTS: Counter = Counter()


def ring_chunks(layout: str, seq_len: int, world_size: int, rank: int) -> list[tuple[int, int, int]]:
    """``(global chunk index, local offset, length)`` of each chunk rank ``rank`` holds, in local order."""
    if layout == "zigzag":
        c = zigzag_chunk_sizes(seq_len, world_size)
        second = 2 * world_size - 1 - rank
        return [(rank, 0, c[rank]), (second, c[rank], c[second])]
    return [(rank, 0, balanced_split_sizes(seq_len, world_size)[rank])]


def _pairs(q_chunks, kv_chunks, causal: bool):
    """Blocks to compute: ``(q_off, q_len, k_off, k_len, diagonal)``; fully masked ones are left out."""
    if not causal:  # one block per step: the whole local query against the whole KV block
        qn, kn = sum(c[2] for c in q_chunks), sum(c[2] for c in kv_chunks)
        return [(0, qn, 0, kn, False)] if qn and kn else []
    out = []
    for qi, qo, qn in q_chunks:
        for ki, ko, kn in kv_chunks:
            if qn and kn and ki <= qi:
                out.append((qo, qn, ko, kn, ki == qi))
    return out


class _Ring:
    """The ring neighbours and the per-rank block sizes of one call."""

    def __init__(self, g: GroupInfo, layout: str, seq_len: int, shapes):
        self.g, self.layout, self.seq_len = g, layout, seq_len
        self.nxt, self.prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        self.chunks = [ring_chunks(layout, seq_len, g.size, r) for r in range(g.size)]
        self.shapes = shapes  # (B, N_kv, D, Dv)

    def src(self, step: int) -> int:
        return (self.g.rank - step) % self.g.size

    def tokens(self, rank: int) -> int:
        return sum(c[2] for c in self.chunks[rank])

    def kv_numel(self, rank: int) -> tuple[int, int]:
        """Elements of rank ``rank``'s k and v blocks (the packed buffer holds both)."""
        b, n_kv, d, dv = self.shapes
        s = self.tokens(rank)
        return b * s * n_kv * d, b * s * n_kv * dv

    def post(self, send: torch.Tensor, recv_numel: int, phase: str):
        """Send ``send`` to the next rank and receive ``recv_numel`` elements from the previous one.

        One ``batch_isend_irecv`` per exchange: with ``R = 2`` both peers are the same rank, and
        every rank posts its exchanges in the same order (FIFO matching, as NCCL requires).
        """
        recv = send.new_empty(recv_numel)
        works = dist.batch_isend_irecv([p2p_op(True, send, self.g.pg, self.nxt), p2p_op(False, recv, self.g.pg, self.prv)])
        ledger.record("send", _OP, phase, self.g.size, send.nbytes, 0)
        ledger.record("recv", _OP, phase, self.g.size, 0, recv.nbytes)
        return works, recv, send  # keep the send buffer alive until waited

    def unpack(self, buf: torch.Tensor, rank: int):
        b, n_kv, d, dv = self.shapes
        nk, s = self.kv_numel(rank)[0], self.tokens(rank)
        return buf[:nk].view(b, s, n_kv, d), buf[nk:].view(b, s, n_kv, dv)


def _wait(pending):
    for w in pending[0]:
        w.wait()
    return pending[1]


def _pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.reshape(-1), b.reshape(-1)])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, causal: bool, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g, rep, acc = ring.g, q.shape[2] // k.shape[2], acc_dtype(q.dtype)
        out = q.new_zeros(*q.shape[:3], v.shape[3], dtype=acc)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        mine = ring.chunks[g.rank]
        kb, vb = k, v
        for step in range(g.size):
            pending = None
            if step < g.size - 1:  # post the next block's transfer before computing on this one
                pending = ring.post(_pack(kb, vb), sum(ring.kv_numel(ring.src(step + 1))), "forward")
            for qo, qn, ko, kn, diag in _pairs(mine, ring.chunks[ring.src(step)], causal):
                o_b, l_b = block_forward(q[:, qo : qo + qn], kb[:, ko : ko + kn], vb[:, ko : ko + kn], diag, scale, rep)
                merge(out[:, qo : qo + qn], lse[:, qo : qo + qn], o_b, l_b)
                BLOCK_COUNTS["forward"] += 1
            if pending is not None:
                kb, vb = ring.unpack(_wait(pending), ring.src(step + 1))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        g, rep, acc = ring.g, q.shape[2] // k.shape[2], acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        mine, (bsz, n_kv, d, dv_dim) = ring.chunks[g.rank], ring.shapes
        kb, vb, grad_pending = k, v, None
        for step in range(g.size):
            src = ring.src(step)
            kv_pending = None
            if step < g.size - 1:  # the KV block is not changed by this step: send it ahead
                kv_pending = ring.post(_pack(kb, vb), sum(ring.kv_numel(ring.src(step + 1))), "backward")
            # this rank's share of block ``src``'s dK/dV, computed while the earlier ranks' share
            # (posted at the end of their previous step) is still in flight
            n_src = ring.tokens(src)
            dk = torch.zeros(bsz, n_src, n_kv, d, dtype=acc, device=k.device)
            dv = torch.zeros(bsz, n_src, n_kv, dv_dim, dtype=acc, device=v.device)
            for qo, qn, ko, kn, diag in _pairs(mine, ring.chunks[src], causal):
                qs, ks = slice(qo, qo + qn), slice(ko, ko + kn)
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, qs], q[:, qs], kb[:, ks], vb[:, ks], out[:, qs], lse[:, qs], diag, scale, rep
                )
                dq[:, qs] += dq_b
                dk[:, ks] += dk_b
                dv[:, ks] += dv_b
                BLOCK_COUNTS["backward"] += 1
            if grad_pending is not None:
                dk_in, dv_in = ring.unpack(_wait(grad_pending), src)
                dk += dk_in
                dv += dv_in
            if kv_pending is not None:
                kb, vb = ring.unpack(_wait(kv_pending), ring.src(step + 1))
            if g.size > 1:  # dK/dV of block ``src`` travel on with it
                grad_pending = ring.post(_pack(dk, dv), sum(ring.kv_numel(ring.src(step + 1))), "backward")
        if grad_pending is not None:  # after R hops the buffer of this rank's own block is home
            dk, dv = ring.unpack(_wait(grad_pending), g.rank)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q, k, v, group, *, causal: bool, scale=None, layout: str = "zigzag", seq_len=None) -> torch.Tensor:
    """Ring attention over a sequence sharded in ``layout``; the ring replayed in backward (dK/dV travel home).

    Args:
        q: ``[B, S_r, N, D]``: this rank's tokens in ``layout`` (zigzag: chunks ``r`` and
            ``2R - 1 - r`` of ``zigzag_chunk_sizes(S, 2R)``, as :func:`zigzag_split` gives;
            contiguous: block ``r`` of ``balanced_split_sizes(S, R)``).
        k: ``[B, S_r, N_kv, D]`` with ``N % N_kv == 0`` (grouped-query attention: query head
            ``h`` uses KV head ``h // (N / N_kv)``; only ``N_kv`` heads travel the ring).
        v: ``[B, S_r, N_kv, Dv]``.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the ring).
        causal: mask keys after each query's global position.
        scale: softmax scale; None for ``1 / sqrt(D)``.
        layout: ``"zigzag"`` (load-balanced for causal attention) or ``"contiguous"``.
        seq_len: the global length ``S``; None means ``S_r x R`` (every rank must then hold the
            same number of tokens). Pass it whenever ``S`` is not a multiple of ``2R`` (zigzag)
            or ``R`` (contiguous).

    Returns:
        ``[B, S_r, N, Dv]`` in ``q.dtype``: attention output for this rank's tokens, same layout.

    Raises:
        ShardkitError: non-4-D inputs, q/k/v disagreeing on ``B``, ``S_r``, ``N_kv`` or ``D``,
            ``N`` not a multiple of ``N_kv``, bad ``scale``/``seq_len``/``layout``, or ``S_r`` not
            this rank's share of ``S`` (a local check: agree first with the check mode when ranks
            may disagree).
        ShardkitTypeError: non-tensor inputs, mixed or non-floating dtypes, bad ``group``.

    Communication (the ledger's ``api="ring_attention"``, one ``batch_isend_irecv`` per
    exchange, recorded as one ``send`` and one ``recv``): forward ``R - 1`` of each (k and v
    packed), backward ``2R - 1`` of each (``R - 1`` KV blocks, ``R`` dK/dV buffers in the
    accumulation dtype). Nothing for ``R = 1``.
    """
    g, _, seq_len = _validate(q, k, v, group, causal, scale, None, seq_len, op=_OP)
    if layout not in LAYOUTS:
        raise ShardkitError(f"{_OP}: layout must be one of {LAYOUTS}, got {layout!r} (group of {g.size})")
    expected = [sum(c[2] for c in ring_chunks(layout, seq_len, g.size, r)) for r in range(g.size)]
    args = (q.shape[2], k.shape[2], q.shape[3], v.shape[3], int(causal), seq_len, LAYOUTS.index(layout))
    maybe_agree(g, _OP, q, args, local_dim=1, expected_local=expected[g.rank])
    if q.shape[1] != expected[g.rank]:
        raise ShardkitError(
            f"{_OP}: rank {g.rank} of {g.size} holds {q.shape[1]} tokens, but the {layout} layout of S = {seq_len} gives it "
            f"{expected[g.rank]} ({expected}); pass seq_len= when S is not a multiple of {'2R' if layout == 'zigzag' else 'R'}"
        )
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    ring = _Ring(g, layout, seq_len, (q.shape[0], k.shape[2], k.shape[3], v.shape[3]))
    return _RingAttention.apply(q, k, v, ring, causal, scale)
