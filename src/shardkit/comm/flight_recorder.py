"""Flight recorder: the last N shardkit collectives of this process, for desync diagnosis.

When ranks disagree on which collective comes next (one rank skipped an op, swapped two, took
the other branch of Megatron's f/g, left the loop early, or both pipeline stages send), the
job hangs until the process-group timeout or the backend aborts, and nothing says where the
ranks parted. Each process therefore keeps a ring buffer of the collectives shardkit issued
(fed by :func:`shardkit.comm.ledger.record`, which every shardkit c10d call goes through
*before* it starts, so the call that never returns is the last entry). After a failure every
rank writes its buffer (:meth:`FlightRecorder.dump`) and :func:`diagnose` compares them: per
process group, entry ``i`` of every member must be the same op, api and phase; per directed
P2P channel, send ``i`` of the sender must meet recv ``i`` of the receiver with the same
shape. The first entry where they differ is reported with the ranks on each side::

    python -m shardkit.comm.flight_recorder DUMP_DIR

Why one recorder per process (the module attribute :data:`current`) and not an argument:
collectives are issued deep inside autograd Functions, often on autograd's worker threads,
where no caller could hand a recorder down; PyTorch's NCCL flight recorder is per process for
the same reason. It is an explicit object all the same: :func:`set_flight_recorder` replaces or
disables it (``None``), and tests build their own. Cost: one tuple appended under a lock per
collective (measured by ``shardkit bench --cases host_overhead``: its ``recorder`` variant).

Source: PyTorch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``fr_trace``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

# The reading side, kept importable from here (its documented home): entries, dumps, diagnosis.
from .flight_report import Divergence, FlightEntry, Wait, diagnose, format_report, load_dumps, main, waited_for

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed import ProcessGroup

__all__ = [
    "FlightRecorder",
    "FlightEntry",
    "Divergence",
    "current",
    "set_flight_recorder",
    "get_flight_recorder",
    "dump_all",
    "load_dumps",
    "diagnose",
    "Wait",
    "waited_for",
    "format_report",
    "DEFAULT_CAPACITY",
]

DEFAULT_CAPACITY = 2048


class FlightRecorder:
    """Ring buffer of the last ``capacity`` collectives of this process.

    Args:
        capacity: number of entries kept (>= 1); older ones are dropped.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"FlightRecorder: capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._buf: list = [None] * capacity
        self._seq = 0
        self._streams: dict = {}
        # id(pg) -> pg: keeps every recorded group alive, so that an id is never reused while
        # it names a stream; the group's ranks and name are looked up only when read.
        self._pgs: dict = {}
        self._groups: dict = {}
        self._lock = threading.Lock()

    def record(
        self,
        op: str,
        api: str,
        phase: str,
        group_size: int,
        pg: ProcessGroup | None = None,
        shape: Sequence[int] | None = None,
        sizes: Sequence[int] | None = None,
        peer: int | None = None,
    ) -> None:
        """Append one collective (called by :func:`shardkit.comm.ledger.record`).

        The hot path stores references only (``shape`` a ``torch.Size`` or tuple, ``sizes`` a
        list the op no longer changes); everything else is derived when the entries are read.
        """
        gid = group_size if pg is None else id(pg)
        if pg is not None and gid not in self._pgs:
            self._pgs[gid] = pg
        key = gid if peer is None else (gid, peer, op)  # P2P: one stream per peer and direction
        with self._lock:
            n = self._streams.get(key, 0)
            self._streams[key] = n + 1
            seq = self._seq
            # the wall time of entry: after a timeout it shows who waited for whom (flight_report.waited_for)
            self._buf[seq % self.capacity] = (seq, n, op, api, phase, gid, shape, sizes, peer, time.time())
            self._seq = seq + 1

    def _group(self, gid):
        """``(name, global ranks, this process's group rank)`` of a recorded group id."""
        hit = self._groups.get(gid)
        if hit is None:
            pg = self._pgs.get(gid)
            if pg is None:  # recorded without its group: only the size is known
                hit = ("", None, None)
            else:
                try:
                    ranks = tuple(dist.get_process_group_ranks(pg))
                except Exception:  # a group torch no longer knows (destroyed): keep the record anyway
                    ranks = None
                hit = (getattr(pg, "group_name", ""), ranks, pg.rank())
            self._groups[gid] = hit
        return hit

    def entries(self) -> list[FlightEntry]:
        """The kept entries, oldest first."""
        with self._lock:
            n, cap = self._seq, self.capacity
            raw = [self._buf[i % cap] for i in range(max(0, n - cap), n)]
        out = []
        for seq, gseq, op, api, phase, gid, shape, sizes, peer, entered in raw:
            name, ranks, me = self._group(gid)
            src = dst = None
            if peer is not None and me is not None:
                src, dst = (me, peer) if op == "send" else (peer, me)
            out.append(
                FlightEntry(
                    seq,
                    gseq,
                    op,
                    api,
                    phase,
                    ranks,
                    name,
                    None if shape is None else tuple(shape),
                    None if sizes is None else tuple(sizes),
                    peer,
                    src,
                    dst,
                    entered,
                )
            )
        return out

    @property
    def total(self) -> int:
        """Number of collectives recorded since creation (kept or dropped)."""
        return self._seq

    def clear(self) -> None:
        """Forget every entry, and the groups they named (they may be destroyed now)."""
        with self._lock:
            self._buf = [None] * self.capacity
            self._seq = 0
            self._streams.clear()
            self._pgs.clear()
            self._groups.clear()

    def dump(self, directory: str, rank: int | None = None, reason: str = "") -> str:
        """Write this process's entries to ``directory/rank{rank}.json`` (atomically); returns the path.

        ``rank`` defaults to the global rank (0 without an initialized process group).
        """
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(directory, exist_ok=True)
        data = {
            "rank": rank,
            "total": self._seq,
            "capacity": self.capacity,
            "reason": reason,
            "time": time.time(),
            "entries": [e.__dict__ for e in self.entries()],
        }
        path = os.path.join(directory, f"rank{rank}.json")
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except BaseException:  # a full disk, an entry json cannot write, SIGTERM mid-write: no tmp left
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


#: This process's recorder (None: disabled). Read by :func:`shardkit.comm.ledger.record`.
current: FlightRecorder | None = FlightRecorder()


def get_flight_recorder() -> FlightRecorder | None:
    """This process's recorder (None when disabled)."""
    return current


def set_flight_recorder(recorder: FlightRecorder | None) -> FlightRecorder | None:
    """Replace this process's recorder (None disables recording); returns the previous one."""
    global current
    if recorder is not None and not isinstance(recorder, FlightRecorder):
        raise TypeError(f"set_flight_recorder: expected a FlightRecorder or None, got {type(recorder).__name__}")
    previous, current = current, recorder
    return previous


def dump_all(directory: str, reason: str = "") -> str | None:
    """Dump this process's recorder to ``directory`` (every rank calls it, e.g. on failure); None if disabled."""
    return None if current is None else current.dump(directory, reason=reason)


if __name__ == "__main__":
    raise SystemExit(main())
