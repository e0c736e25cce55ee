"""The communication plan of a stage made of a tp group, one boundary transfer at a time.

:func:`~.runner.run_schedule` turns a schedule row into :class:`~.schedules.CommCall` s; for a
stage with a :class:`~.vtp.StageGroups` each call's transfers (send to next, receive from
previous, ...) run here, in the fixed even/odd slot order of :mod:`._exchange`
(:func:`~._transfer.order_key`), each complete before the next. Every rank of a stage runs the
same calls, so a stage behaves like one pipeline rank with blocking P2P and the deadlock
freedom the schedule simulator proves for one rank per stage carries over; inside a transfer
the piece order of :func:`~.vtp.piece_plan` is deadlock-free on its own.

Gradients travel with static shapes: the gradient of a boundary tensor has its shape and dtype,
which both sides know from the forward (no header). Activations negotiate (a header, so
microbatches may differ in shape) unless the caller declares static boundary shapes.
"""

from __future__ import annotations

from ..comm._group import GroupInfo
from ._reshard import Side, recv_side, send_side
from ._transfer import order_key

__all__ = ["StageTransport"]


class StageTransport:
    """Boundary transfers of one stage of a :class:`~.vtp.StageGroups` pipeline.

    Args:
        stages: the :class:`~.vtp.StageGroups`.
        layouts: per stage ``(in_layout, out_layout, input_grad)`` (agreed by every rank).
    """

    def __init__(self, stages, layouts) -> None:
        self.stages, self.layouts = stages, layouts
        self.s = stages.stage_index
        self.pg: GroupInfo = stages.info
        self.tp: GroupInfo = stages.tp

    def _sides(self, towards: str, sending: bool) -> tuple[Side, Side]:
        """(src, dst) of the boundary with the neighbour ``towards``, in the direction of the
        message: forward messages go from an out layout to an in layout, gradients back."""
        s = self.s
        other = s + 1 if towards == "next" else s - 1
        lo, hi = min(s, other), max(s, other)  # the boundary lies between stages lo and lo + 1
        out_side = Side(self.stages.stage_ranks[lo], self.layouts[lo][1])
        in_side = Side(self.stages.stage_ranks[hi], self.layouts[hi][0])
        forward = (towards == "next") == sending
        return (out_side, in_side) if forward else (in_side, out_side)

    def run(self, api: str, sends: list, recvs: list, device, done) -> None:
        """Run one :class:`~.schedules.CommCall`.

        Args:
            sends: ``[(towards, key, tensor, decl)]``; ``decl`` None, ``(full shape, dtype)``
                or a function returning one, called when the transfer starts.
            recvs: ``[(towards, key, decl)]``.
            done: ``done(key, tensor or None, full shape)`` after each transfer: received
                tensors, and for sends the full shape sent (its gradient comes back with it).
                A combined call's receive may need what its send reported (1F1B: the gradient
                of the output just sent), hence one transfer at a time.
        """
        items = [(True, t, k, x, d) for t, k, x, d in sends] + [(False, t, k, None, d) for t, k, d in recvs]
        items.sort(key=lambda it: order_key(self.s, it[0], it[1]))
        for is_send, towards, key, x, decl in items:
            src, dst = self._sides(towards, is_send)
            phase = "forward" if (towards == "next") == is_send else "backward"
            decl = decl() if callable(decl) else decl
            if is_send:
                done(key, None, send_side(x, src, dst, self.pg, self.tp, decl, api, phase))
            else:
                done(key, *recv_side(src, dst, self.pg, self.tp, decl, device, api, phase))
