"""Collective matmul: a sequence all-gather or reduce-scatter decomposed into ring steps that
overlap the matmuls producing or consuming it (async tensor parallelism).

Two ring engines on plain point-to-point calls in the tp group (``batch_isend_irecv``: each rank
sends to ``r + 1`` and receives from ``r - 1``; no symmetric memory, any backend):

* :func:`ring_gather_apply`: all-gather by ``R - 1`` ring steps; ``fn(src, chunk)`` runs on each
  rank's block (its own first) while the next block is in flight.
* :func:`ring_reduce_scatter`: each rank computes the partial sum of one destination block at a
  time and passes the accumulator on; step ``s`` computes the block for rank ``r - s - 1``, so
  after ``R - 1`` hand-offs rank ``r`` adds its own block's partial last and holds the sum.

On them, two autograd Functions, each the other's backward:

* :func:`all_gather_matmul`: sequence-sharded ``x [B, S_r, H]`` -> ``(full [B, S, H], y_j = full
  W_j^T + b_j)`` for the column-parallel projections that read the gathered input (q/k/v, gate/up:
  one ring for the group). Backward: the input gradient ``sum_j dy_j W_j + dfull`` as a ring
  reduce-scatter, and each weight gradient ``dy_j^T full`` on a ring regather of the kept shard
  (``keep="shard"``) or from the kept ``full`` (``keep="gathered"``).
* :func:`matmul_reduce_scatter`: row-parallel ``x [B, S, in_r] @ W^T`` reduce-scattered along the
  sequence -> ``[B, S_r, out]``. Backward: the output gradient all-gathered by the ring while
  each block's input-gradient rows and weight-gradient term are computed.

Ledger (one record per message, before it is posted): ``send`` / ``recv`` in the tp group with
the block's bytes, ``api="all_gather_matmul"`` (forward ring; backward: its reduce-scatter ring),
``"sp_regather"`` (the weight gradient's regather, phase ``"recompute"``) and
``"matmul_reduce_scatter"``. A zero-size block is not sent (every rank knows the sizes).
Values equal the synchronous path's up to the order of floating-point sums.

Source: Wang et al., "Overlap Communication with Dependent Computation via Decomposition in
Large Deep Learning Models" (ASPLOS 2023); the same decomposition as PyTorch's async TP
(micro-pipeline TP) and torchtitan's ``enable_async_tensor_parallel``, here on stable c10d P2P.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._shapes import split_offsets
from . import ledger
from ._compat import p2p_op
from ._group import GroupInfo
from .replay_scope import unreplayed
from .split_pass import in_input_pass, will_execute

__all__ = ["ring_gather_apply", "ring_reduce_scatter", "all_gather_matmul", "matmul_reduce_scatter"]


def _post(g: GroupInfo, send: torch.Tensor | None, recv: torch.Tensor | None, api: str, phase: str) -> list:
    """Record and post one ring step: ``send`` to ``r + 1``, ``recv`` from ``r - 1`` (None: no message)."""
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    ops = []
    if send is not None and send.numel():
        ledger.record("send", api, phase, g.size, send.nbytes, 0, pg=g.pg, shape=send.shape, peer=nxt, dtype=send.dtype)
        ops.append(p2p_op(True, send, g.pg, nxt))
    if recv is not None and recv.numel():
        ledger.record("recv", api, phase, g.size, 0, recv.nbytes, pg=g.pg, shape=recv.shape, peer=prv, dtype=recv.dtype)
        ops.append(p2p_op(False, recv, g.pg, prv))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _shape(x: torch.Tensor, dim: int, n: int) -> list[int]:
    return _shape_of(list(x.shape), dim, n)


def _shape_of(shape: list[int], dim: int, n: int) -> list[int]:
    out = list(shape)
    out[dim] = n
    return out


def ring_gather_apply(
    x: torch.Tensor,
    g: GroupInfo,
    dim: int,
    sizes: Sequence[int],
    fn: Callable[[int, torch.Tensor], None],
    api: str,
    phase: str,
) -> None:
    """Pass every rank's block ``x`` (``[..., sizes[r], ...]`` along ``dim``) around the ring and
    call ``fn(src, block)`` on each, this rank's first, while the next block is in flight.

    ``R - 1`` steps, each one send and one receive of one block (module docstring)."""
    R, r = g.size, g.rank
    cur = x.contiguous()
    with unreplayed():  # a selective checkpoint must not keep the blocks (the memory the shard layout saves)
        for s in range(R):
            src = (r - s) % R
            works, nxt = [], None
            if s < R - 1:
                nxt = cur.new_empty(_shape(cur, dim, sizes[(r - s - 1) % R]))
                works = _post(g, cur, nxt, api, phase)
            fn(src, cur)  # the matmul of this block overlaps the transfer of the next
            _wait(works)
            if nxt is not None:
                cur = nxt


def ring_reduce_scatter(
    partial: Callable[[int], torch.Tensor],
    shape: Callable[[int], list[int]],
    g: GroupInfo,
    api: str,
    phase: str,
) -> torch.Tensor:
    """The sum over ranks of ``partial(r)`` (this rank's block's partial sum on each rank), by
    passing accumulators around the ring: ``partial(d)`` of the next destination is computed
    while the previous accumulator is in flight. ``partial(d)`` returns a new tensor of
    ``shape(d)`` (the same on every rank)."""
    R, r = g.size, g.rank
    acc = partial((r - 1) % R)
    with unreplayed():
        for s in range(1, R):
            # the accumulator for destination r - s - 1, from rank r - 1
            buf = acc.new_empty(shape((r - s - 1) % R))
            works = _post(g, acc, buf, api, phase)
            mine = partial((r - s - 1) % R)  # overlaps the transfer
            _wait(works)
            acc = mine.add_(buf)
    return acc


class _Recomputed(threading.local):
    """Gathered inputs of a checkpoint's recompute, by the shard they gathered, for the original
    node's weight gradients in the same backward (the recompute's own node is discarded; the
    checkpoint hands the original node the recomputed shard, the same storage). Entries of an
    earlier backward are dropped when a new one is published; an entry is taken once."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple[int, torch.Tensor]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))

    def publish(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        self.entries = {k: v for k, v in self.entries.items() if v[0] == task}
        self.entries[self._key(shard)] = (task, full.detach())

    def take(self, shard: torch.Tensor) -> torch.Tensor | None:
        if not self.entries:
            return None
        hit = self.entries.pop(self._key(shard), None)
        return hit[1] if hit is not None and hit[0] == torch._C._current_graph_task_id() else None


_RECOMPUTED = _Recomputed()


def _rows(t: torch.Tensor, dim: int, offsets: Sequence[int], sizes: Sequence[int], i: int) -> torch.Tensor:
    return t.narrow(dim, offsets[i], sizes[i])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, dim, sizes, keep, n, *params):
        weights, biases = params[:n], params[n:]
        offsets = split_offsets(sizes)
        full = x.new_empty(_shape(x, dim, sum(sizes)))
        ys = [full.new_empty(_shape(full, -1, w.shape[0])) for w in weights]

        def block(src: int, chunk: torch.Tensor) -> None:
            _rows(full, dim, offsets, sizes, src).copy_(chunk)
            for y, w, b in zip(ys, weights, biases):
                _rows(y, dim, offsets, sizes, src).copy_(F.linear(chunk, w, b))

        ring_gather_apply(x, g, dim, sizes, block, "all_gather_matmul", "forward")
        kept = full if keep == "gathered" else x
        if kept is x and torch._C._current_graph_task_id() != -1:
            _RECOMPUTED.publish(x, full)  # a checkpoint's recompute: the original node takes this gather
        ctx.save_for_backward(kept, *weights)  # the same tensors in a recompute (checkpoint checks them)
        ctx.g, ctx.dim, ctx.sizes, ctx.offsets, ctx.n = g, dim, list(sizes), offsets, n
        ctx.is_full = kept is full
        ctx.has_bias = [b is not None for b in biases]
        return (full, *ys)

    @staticmethod
    def backward(ctx, dfull, *dys):
        kept, *weights = ctx.saved_tensors
        g, dim, sizes, offsets = ctx.g, ctx.dim, ctx.sizes, ctx.offsets
        need = ctx.needs_input_grad
        need_x = need[0] and will_execute(ctx.next_functions[0])
        need_w = [need[6 + j] and not in_input_pass() for j in range(ctx.n)]
        need_b = [need[6 + ctx.n + j] and ctx.has_bias[j] and not in_input_pass() for j in range(ctx.n)]
        dx = None
        if need_x:

            def partial(d: int) -> torch.Tensor:
                acc = None if dfull is None else _rows(dfull, dim, offsets, sizes, d).clone()
                for dy, w in zip(dys, weights):
                    if dy is not None:
                        term = _rows(dy, dim, offsets, sizes, d).matmul(w)
                        acc = term if acc is None else acc.add_(term)
                if acc is None:
                    acc = torch.zeros(_shape(kept, dim, sizes[d]), dtype=kept.dtype, device=kept.device)
                return acc

            dx = ring_reduce_scatter(partial, lambda d: _shape(kept, dim, sizes[d]), g, "all_gather_matmul", "backward")
        dws: list = [None] * ctx.n
        if any(need_w):
            dws = [torch.zeros_like(w) if need_w[j] and dys[j] is not None else None for j, w in enumerate(weights)]
            full = kept if ctx.is_full else _RECOMPUTED.take(kept)
            if full is not None:
                for j, dy in enumerate(dys):
                    if dws[j] is not None:
                        dws[j] = _flat(dy).t().mm(_flat(full))
            else:

                def block(src: int, chunk: torch.Tensor) -> None:
                    for j, dy in enumerate(dys):
                        if dws[j] is not None:
                            dws[j].addmm_(_flat(_rows(dy, dim, offsets, sizes, src)).t(), _flat(chunk))

                ring_gather_apply(kept, g, dim, sizes, block, "sp_regather", "recompute")
        dbs = [_flat(dy).sum(0) if need_b[j] and dy is not None else None for j, dy in enumerate(dys)]
        return (dx, None, None, None, None, None, *dws, *dbs)


def all_gather_matmul(
    x: torch.Tensor,
    g: GroupInfo,
    dim: int,
    sizes: Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    keep: str = "shard",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather ``x`` along ``dim`` and apply each column-parallel linear to the gathered
    input, block by block while the ring moves the next block; backward: a ring reduce-scatter
    of the input gradient and the weight gradients on a ring regather (module docstring).

    Args:
        x: this rank's block ``[B, S_r, H]`` (``sizes[r]`` along ``dim``, not the last dim).
        g: the tp group (``R >= 2``).
        sizes: every rank's block size along ``dim``.
        weights: ``[out_j, H]`` each; biases: ``[out_j]`` or None each.
        keep: ``"shard"`` keeps ``x`` for the weight gradients (regathered by the ring in
            backward), ``"gathered"`` keeps the gathered input.

    Returns:
        ``(full [B, S, H], [y_j [B, S, out_j]])``; ``full`` is differentiable (a replicated
        reader's gradient joins the reduce-scatter).
    """
    n = len(weights)
    outs = _AllGatherMatmul.apply(x, g, dim % x.dim(), list(sizes), keep, n, *weights, *biases)
    return outs[0], list(outs[1:])


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, g, dim, sizes):
        offsets = split_offsets(sizes)
        ctx.save_for_backward(x, weight)
        ctx.g, ctx.dim, ctx.sizes, ctx.offsets = g, dim, list(sizes), offsets
        out = _shape(x, -1, weight.shape[0])
        return ring_reduce_scatter(
            lambda d: F.linear(_rows(x, dim, offsets, sizes, d), weight),
            lambda d: _shape_of(out, dim, sizes[d]),
            g,
            "matmul_reduce_scatter",
            "forward",
        )

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g, dim, sizes, offsets = ctx.g, ctx.dim, ctx.sizes, ctx.offsets
        need_x = ctx.needs_input_grad[0] and will_execute(ctx.next_functions[0])
        need_w = ctx.needs_input_grad[1] and not in_input_pass()
        gathered = getattr(ctx, "gathered", None)  # the I pass's gathered gradient, for the W pass
        dx = x.new_empty(x.shape) if need_x else None
        dw = torch.zeros_like(weight) if need_w else None
        keep = in_input_pass() and ctx.needs_input_grad[1]
        full = grad.new_empty(_shape(grad, dim, sum(sizes))) if keep else None

        def block(src: int, chunk: torch.Tensor) -> None:
            if dx is not None:
                _rows(dx, dim, offsets, sizes, src).copy_(chunk.matmul(weight))
            if dw is not None:
                dw.addmm_(_flat(chunk).t(), _flat(_rows(x, dim, offsets, sizes, src)))
            if full is not None:
                _rows(full, dim, offsets, sizes, src).copy_(chunk)

        if gathered is not None and dx is None and dw is not None:
            dw = _flat(gathered).t().mm(_flat(x))
        elif dx is not None or dw is not None or full is not None:
            ring_gather_apply(grad, g, dim, sizes, block, "matmul_reduce_scatter", "backward")
        ctx.gathered = full
        return dx, dw, None, None, None


def matmul_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, g: GroupInfo, dim: int, sizes: Sequence[int]
) -> torch.Tensor:
    """``F.linear(x, weight)`` summed over ranks and scattered along ``dim`` by the ring, each
    destination block's matmul overlapping the previous block's transfer; backward: a ring
    all-gather of the output gradient, each block's input- and weight-gradient terms computed as
    it arrives (module docstring).

    Args:
        x: ``[B, S, in_r]`` (this rank's input features; the full sequence).
        weight: ``[out, in_r]``. g: the tp group (``R >= 2``).
        dim: the sequence dim; sizes: every rank's block along it (summing to ``S``).

    Returns:
        This rank's block ``[B, S_r, out]`` of the sum over ranks (no bias).
    """
    return _MatmulReduceScatter.apply(x, weight, g, dim % x.dim(), list(sizes))
