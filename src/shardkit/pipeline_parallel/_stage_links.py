"""The chunked runner's transport for stages made of tp groups (:class:`~.vtp.StageGroups`,
tp sizes may differ per stage): one message of a table is one boundary reshard of
:mod:`._reshard` between the sending and the receiving stage's layouts.

Every rank of a stage runs the same row, so the collectives inside a stage (the sending stage's
header all-gather, the receiving leader's broadcast, the sum of partial input gradients) meet in
the same order on all of its ranks. Each message travels on the process group of its link
between the two stages (:func:`~._mailbox.link_groups` over the replica group: one per link on
NCCL, so that each stream carries one direction; the tests' stream model checks the order at
the level of ranks, ``tp_posting_order`` of ``tests/harness/stream_model.py``). Sends are
posted and waited for at the end of the call (:class:`~._mailbox.Mailbox`), as the one-rank
transport's; a receive runs, whole, when the step
needs it (it holds collectives of the receiving stage, which cannot be posted early). Between
two ranks a transfer's messages are posted in the same order on both ends and transfers follow
the sender's order (:func:`.simulate.transfers`): FIFO pairing suffices, no tags.

Without declared ``boundary_shapes`` an activation's message carries a header (its full shape and
dtype); its gradient, which autograd gives the same shape and dtype, goes without one: both ends
remember what the activation's header said (per microbatch and boundary, for this call).

Gradients have the layout of their values (:mod:`.vtp`). A stage whose replicated input feeds
its tp regions without Megatron's ``f`` (``input_grad="partial"``) sums its ranks' input
gradients over the stage before sending them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..comm import _c10d
from ..comm.checks import checks_enabled
from ._links import Posted
from ._mailbox import link
from ._reshard import Side, recv_side, send_side
from .vtp import Replicate

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._mailbox import Message
    from .stage import PipelineStage

__all__ = ["StageLinks"]


class StageLinks:
    """:class:`~._mailbox.Transport` of a tp-group stage (see the module docstring).

    Args:
        stage: a :class:`~.stage.PipelineStage` built on :class:`~.vtp.StageGroups` (its
            ``layouts`` agreed by every rank); pipeline rank = stage index.
        decls: per boundary ``(full shape, dtype)``, or None (negotiated: a header per message).
    """

    def __init__(self, stage: PipelineStage, decls: Sequence[tuple] | None = None) -> None:
        st = stage.stages
        assert st is not None  # only tp-group stages get here
        self.stage, self.st, self.decls = stage, st, decls
        self.device = next((q.device for q in stage.module.parameters()), torch.device("cpu"))
        s = stage.stage_index
        self.partial = st.tp.size > 1 and stage.input_grad == "partial" and isinstance(stage.layouts[s][0], Replicate)
        self.checked = checks_enabled()
        # (microbatch, boundary) -> (full shape, dtype) of the activation that crossed it: its
        # gradient's declaration (see the module docstring)
        self.forward: dict[tuple[int, int], tuple] = {}

    def _sides(self, sender: int, receiver: int) -> tuple[Side, Side]:
        """(src, dst) of a message between stages ``sender`` and ``receiver``: an activation goes
        from the lower stage's out layout to the upper's in layout, a gradient back."""
        lo = min(sender, receiver)  # the boundary lies between stages lo and lo + 1
        out_side = Side(self.st.stage_ranks[lo], self.stage.layouts[lo][1])
        in_side = Side(self.st.stage_ranks[lo + 1], self.stage.layouts[lo + 1][0])
        return (out_side, in_side) if sender == lo else (in_side, out_side)

    def _decl(self, msg: Message) -> Any:
        boundary = msg[2] - 1 if msg[0] == "F" else msg[2]
        if self.decls is not None:
            return self.decls[boundary]
        return None if msg[0] == "F" else self.forward.pop((msg[1], boundary))

    def _crossed(self, msg: Message, shape, dtype: torch.dtype) -> None:
        """Remember an activation's full shape and dtype for its gradient's message."""
        if msg[0] == "F" and self.decls is None:
            self.forward[(msg[1], msg[2] - 1)] = (tuple(shape), dtype)

    def send(self, msg: Message, dst: int, tensor: torch.Tensor) -> Posted:
        api, phase = ("send_forward", "forward") if msg[0] == "F" else ("send_backward", "backward")
        if msg[0] == "B" and self.partial:  # partial sums -> the full gradient
            tensor = _c10d.all_reduce(tensor, self.st.tp, "run_schedule", "backward")
        s = self.stage.stage_index
        src, to = self._sides(s, dst)
        pg = self.stage.links[link(s, dst, self.st.num_stages)]
        shape, works = send_side(tensor, src, to, pg, self.st.tp, self._decl(msg), api, phase)
        self._crossed(msg, shape, tensor.dtype)
        return Posted(works)

    def post(self, msg: Message, src: int) -> tuple[Message, int]:
        return msg, src  # received whole when the step takes it (see the module docstring)

    def receive(self, handle: tuple[Message, int]) -> torch.Tensor:
        msg, src = handle
        api, phase = ("recv_forward", "forward") if msg[0] == "F" else ("recv_backward", "backward")
        s = self.stage.stage_index
        frm, to = self._sides(src, s)
        pg = self.stage.links[link(src, s, self.st.num_stages)]  # the sender's link
        out, shape = recv_side(frm, to, pg, self.st.tp, self._decl(msg), self.device, api, phase)
        self._crossed(msg, shape, out.dtype)
        return out
