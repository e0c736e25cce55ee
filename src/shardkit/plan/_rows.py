"""The planner's row of collectives (:class:`CommRow`) and the table that sums them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CommRow", "Rows"]


@dataclass(frozen=True)
class CommRow:
    """Calls of one kind in one step on one rank.

    Attributes:
        axis: the layout axis it belongs to (``tp``, ``cp``, ``ep``, ``pp``, ``dp``, ``fsdp``, ``world``).
        op: the c10d primitive (as :class:`shardkit.CommRecord`).
        api: the shardkit function that issues it (``"p2p"`` for pipeline transfers).
        phase: ``forward``, ``backward`` or ``optimizer``.
        group_size: ranks in the group.
        count: calls per step.
        bytes_sent: input buffer bytes, summed over the calls.
        bytes_received: output buffer bytes, summed over the calls.
    """

    axis: str
    op: str
    api: str
    phase: str
    group_size: int
    count: int
    bytes_sent: int
    bytes_received: int

    def key(self) -> tuple[str, str, str, int]:
        return self.op, self.api, self.phase, self.group_size


class Rows:
    """Rows keyed by ``(axis, op, api, phase, group size)``; size-1 groups are left out."""

    def __init__(self) -> None:
        self.rows: dict[tuple, list[int]] = {}

    def add(self, axis: str, op: str, api: str, phase: str, group: int, count: int, sent: int, recv: int) -> None:
        """``count`` calls of ``sent`` / ``recv`` bytes each."""
        self.add_total(axis, op, api, phase, group, count, count * sent, count * recv)

    def add_total(self, axis: str, op: str, api: str, phase: str, group: int, count: int, sent: int, recv: int) -> None:
        """``count`` calls of ``sent`` / ``recv`` bytes in all."""
        if group <= 1 or count <= 0:
            return  # a size-1 group is the identity: no call
        row = self.rows.setdefault((axis, op, api, phase, group), [0, 0, 0])
        row[0] += count
        row[1] += sent
        row[2] += recv

    def result(self) -> list[CommRow]:
        return [CommRow(*key, *vals) for key, vals in self.rows.items()]
