"""The ring of one :func:`~shardkit.context_parallel.ring_attention` call: neighbours, block plans, exchanges.

Split from :mod:`.ring` (the autograd Function and the public function) to keep each file small.
``_Ring.post`` is the one place the ring's point-to-point traffic is posted and recorded in the
ledger; ``_Pending`` keeps the send buffers alive until the exchange is waited for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._shapes import balanced_split_sizes
from ..comm import ledger
from ..comm._compat import p2p_op
from ..comm._group import GroupInfo
from ._ring_plan import block_plan
from ._sizes import packed_local_sizes

__all__ = ["_Ring", "_Pending", "layout_sizes", "ring_kv"]

_OP = "ring_attention"


def ring_kv(k, kv_index):
    """Local KV heads as ``ring_attention`` wants them: query head ``h`` -> KV head ``h // rep``.

    The Ulysses plan already has that form unless a GQA group straddles a rank boundary; then the
    KV heads are expanded to one per query head (autograd sums their gradients).
    """
    if kv_index is None:
        return k
    n_q, n_kv = len(kv_index), k.shape[2]
    if n_kv and n_q % n_kv == 0 and tuple(kv_index) == tuple(i // (n_q // n_kv) for i in range(n_q)):
        return k
    return k.index_select(2, torch.tensor(kv_index, dtype=torch.int64, device=k.device))


def layout_sizes(layout: str, cu: tuple[int, ...], world_size: int) -> list[int]:
    """Tokens of every rank in ``layout`` (packed zigzag with several documents; stripe: every ``R``-th token)."""
    if layout == "stripe":
        return [len(range(r, cu[-1], world_size)) for r in range(world_size)]
    return packed_local_sizes(cu, world_size) if layout == "zigzag" else balanced_split_sizes(cu[-1], world_size)


class _Ring:
    """The ring neighbours, per-rank block sizes and block plans of one call."""

    def __init__(
        self,
        g: GroupInfo,
        layout: str,
        cu: tuple[int, ...],
        causal: bool,
        overlap: bool,
        shapes,
        counts=None,
        window: tuple[int, int] | None = None,
        min_tile: int = 0,
    ):
        self.g, self.layout, self.overlap, self.counts = g, layout, overlap, counts
        self.nxt, self.prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        self.sizes = layout_sizes(layout, cu, g.size)
        self.shapes = shapes  # (B, N_kv, D, Dv)
        self.plans = [
            block_plan(layout, cu, g.size, g.rank, self.src(i), causal, min_tile, window) for i in range(g.size)
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
