"""CommLedger: an exact record of every collective shardkit issues.

Every c10d call shardkit makes goes through :func:`record`, so a ledger sees forward and backward
traffic alike (backward may run on autograd worker threads, hence a process-wide, lock-guarded
list of open ledgers rather than thread- or context-local state).

Bytes are buffer bytes: ``bytes_sent`` is the size of the input buffer handed to c10d and
``bytes_received`` the size of the output buffer it fills, the "size" convention of nccl-tests.
They are exact and independent of the backend's algorithm; bus bandwidth follows from them with
the nccl-tests factors (see ``benchmarks/``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from . import flight_recorder as _flight

__all__ = ["CommLedger", "CommRecord", "record"]

_lock = threading.Lock()
_open: list[CommLedger] = []


@dataclass(frozen=True)
class CommRecord:
    """One c10d call.

    Attributes:
        op: the c10d primitive issued (``all_reduce``, ``all_gather_single``,
            ``reduce_scatter_single``, ``all_to_all_single``, ``metadata_all_gather``, ...).
        api: the shardkit function that issued it (``all_gather``, ``all_to_all``, ...).
        phase: ``"forward"`` or ``"backward"`` (or ``"check"`` for cross-rank metadata checks);
            ``"recompute"`` for a forward call issued again while autograd runs backward
            (activation checkpointing recomputes the block).
        group_size: number of ranks in the group.
        bytes_sent: bytes of the input buffer on this rank.
        bytes_received: bytes of the output buffer on this rank.
        group_name: the process group's name (``ProcessGroup.group_name``; None when the caller
            did not pass the group): which mesh axis the call ran on
            (:meth:`shardkit.ParallelMesh.axis_of`).
        dtype: the dtype of the data the call moves (``"float32"``, ``"bfloat16"``, ...; None when
            the caller did not say): mixed precision shows its reductions in float32 here.
    """

    op: str
    api: str
    phase: str
    group_size: int
    bytes_sent: int
    bytes_received: int
    group_name: str | None = None
    dtype: str | None = None


class CommLedger:
    """Context manager recording every collective shardkit issues on this process.

    Example:
        >>> with CommLedger() as ledger:
        ...     y = all_to_all(x, tp_group, scatter_dim=2, gather_dim=1)
        ...     y.sum().backward()
        >>> ledger.count(op="all_to_all_single")          # 2: one forward, one backward
        >>> ledger.count(api="all_to_all", phase="backward")
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommLedger:
        with _lock:
            _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _open.remove(self)

    def _select(self, op=None, api=None, phase=None, group_size=None, dtype=None):
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (api is None or r.api == api)
            and (phase is None or r.phase == phase)
            and (group_size is None or r.group_size == group_size)
            and (dtype is None or r.dtype == dtype)
        ]

    def count(
        self,
        op: str | None = None,
        api: str | None = None,
        phase: str | None = None,
        group_size: int | None = None,
        dtype: str | None = None,
    ) -> int:
        """Number of recorded calls matching every given field (``dtype`` by name, e.g. ``"float32"``)."""
        return len(self._select(op, api, phase, group_size, dtype))

    def bytes_sent(
        self, op: str | None = None, api: str | None = None, phase: str | None = None, group_size: int | None = None
    ) -> int:
        return sum(r.bytes_sent for r in self._select(op, api, phase, group_size))

    def bytes_received(
        self, op: str | None = None, api: str | None = None, phase: str | None = None, group_size: int | None = None
    ) -> int:
        return sum(r.bytes_received for r in self._select(op, api, phase, group_size))

    def summary(self) -> dict[tuple[str, int], dict[str, int]]:
        """``{(op, group_size): {"count", "bytes_sent", "bytes_received"}}`` over all phases."""
        table: dict[tuple[str, int], dict[str, int]] = defaultdict(
            lambda: dict(count=0, bytes_sent=0, bytes_received=0)
        )
        for r in self.records:
            row = table[(r.op, r.group_size)]
            row["count"] += 1
            row["bytes_sent"] += r.bytes_sent
            row["bytes_received"] += r.bytes_received
        return dict(table)


def record(
    op: str,
    api: str,
    phase: str,
    group_size: int,
    bytes_sent: int,
    bytes_received: int,
    *,
    pg=None,
    shape=None,
    sizes=None,
    peer: int | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Append one call to every open ledger and to the flight recorder.

    Call it just *before* the c10d call it describes, so that a call that never returns is the
    last entry of the flight recorder (:mod:`.flight_recorder`). The keyword arguments only feed
    the recorder: ``pg`` the process group (its ranks name the group in a desync report),
    ``shape`` the local tensor shape, ``sizes`` the per-rank split sizes, ``peer`` the group
    rank of the other side of a ``send``/``recv``. ``dtype``: the dtype of the data moved (kept in
    :attr:`CommRecord.dtype` by its name).
    """
    if phase != "backward" and torch._C._current_graph_task_id() != -1:
        # a forward-side call inside backward: an activation-checkpointed block recomputing
        if _replayed(op):
            return  # served from the kept result (parallelize.checkpointing.CollectiveReplay): not issued
        phase = "recompute" if phase == "forward" else phase
    rec_ = _flight.current
    if rec_ is not None:
        rec_.record(op, api, phase, group_size, pg, shape, sizes, peer)
    if not _open:
        return
    rec = CommRecord(
        op,
        api,
        phase,
        group_size,
        bytes_sent,
        bytes_received,
        None if pg is None else pg.group_name,
        None if dtype is None else str(dtype).removeprefix("torch."),
    )
    with _lock:
        for ledger in _open:
            ledger.records.append(rec)


def _replayed(op: str) -> bool:
    """Whether a dispatch mode on the stack serves ``op`` from a kept result instead of issuing it
    (a mode advertising ``replayed_ledger_ops``: the selective checkpoint's replay)."""
    return any(op in getattr(m, "replayed_ledger_ops", ()) for m in _get_current_dispatch_mode_stack())
