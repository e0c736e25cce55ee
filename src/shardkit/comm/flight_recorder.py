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

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

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
    "format_report",
    "DEFAULT_CAPACITY",
]

DEFAULT_CAPACITY = 2048
_P2P = ("send", "recv")


@dataclass(frozen=True)
class FlightEntry:
    """One recorded collective.

    Attributes:
        seq: this process's call number (all groups).
        group_seq: the call number within its stream: the process group, or for ``send``/``recv``
            the directed channel ``(src, dst)`` of that group.
        op: the c10d primitive (``all_to_all_single``, ``send``, ...).
        api: the shardkit function that issued it.
        phase: ``forward``, ``backward``, ``metadata`` or ``check``.
        group: global ranks of the group (None when the caller did not pass the group).
        group_name: the process group's name (same on every rank).
        shape: local tensor shape, when known.
        sizes: per-rank split sizes, when known.
        peer: for P2P, the other side's group rank.
        src, dst: for P2P, sender and receiver group ranks.
    """

    seq: int
    group_seq: int
    op: str
    api: str
    phase: str
    group: tuple | None
    group_name: str
    shape: tuple | None
    sizes: tuple | None
    peer: int | None
    src: int | None
    dst: int | None

    def describe(self) -> str:
        shape = f" {list(self.shape)}" if self.shape is not None else ""
        peer = ""
        if self.op in _P2P and self.peer is not None and self.group is not None:
            peer = f" {'to' if self.op == 'send' else 'from'} rank {self.group[self.peer]}"
        return f"{self.op}{shape}{peer} in {self.api} {self.phase}"

    def signature(self):
        """What every member of a group stream must agree on."""
        return (self.op, self.api, self.phase)


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
            self._buf[seq % self.capacity] = (seq, n, op, api, phase, gid, shape, sizes, peer)
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
        for seq, gseq, op, api, phase, gid, shape, sizes, peer in raw:
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
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
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


def load_dumps(directory: str) -> dict[int, list[FlightEntry]]:
    """``{global rank: entries}`` from the ``rank*.json`` files :meth:`FlightRecorder.dump` wrote."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                data = json.load(f)
            out[int(data["rank"])] = [_entry(e) for e in data["entries"]]
    return out


@dataclass(frozen=True)
class Divergence:
    """The first call of one stream (group or P2P channel) where the ranks disagree.

    Attributes:
        group: global ranks of the group.
        call: the call number within the stream (``FlightEntry.group_seq``).
        sides: ``(global ranks, FlightEntry or None)`` per distinct behaviour; None means
            the ranks issued no such call (left early, or hung before it).
        order: smallest per-process call number involved (to find the earliest divergence).
    """

    group: tuple
    call: int
    sides: tuple
    order: int
    channel: tuple | None = None

    def describe(self) -> str:
        parts = []
        for i, (ranks, entry) in enumerate(self.sides):
            who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            what = entry.describe() if entry is not None else "no such call (left early or stuck before it)"
            parts.append(f"{who} at call {self.call}: {what}" if i == 0 else f"{who}: {what}")
        where = f"group {list(self.group)}"
        if self.channel is not None:
            where += f", P2P {self.channel[0]} -> {self.channel[1]}"
        return f"{'; '.join(parts)} ({where})"


def _entry(fields: dict[str, Any]) -> FlightEntry:
    """A :class:`FlightEntry` from its JSON object (JSON arrays back to tuples)."""
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return FlightEntry(**values)


def _streams(dumps: dict[int, list[FlightEntry]]):
    """``{stream key: {global rank: {group_seq: entry}}}``; P2P entries go to their directed channel."""
    streams: dict = defaultdict(lambda: defaultdict(dict))
    for rank, entries in dumps.items():
        for e in entries:
            if e.group is None:
                continue  # recorded without its group: cannot be matched across ranks
            key: tuple[Any, ...]
            if e.src is not None and e.dst is not None:
                key = (e.group_name, e.group, (e.group[e.src], e.group[e.dst]))
            else:
                key = (e.group_name, e.group, None)
            streams[key][rank][e.group_seq] = e
    return streams


def _first_divergence(key, per_rank: dict, dumps) -> Divergence | None:
    name, group, channel = key
    members = [r for r in (channel if channel is not None else group) if r in dumps]
    if len(members) < 2:
        return None
    seqs = {r: per_rank.get(r, {}) for r in members}
    start = max((min(s) for s in seqs.values() if s), default=0)
    end = max((max(s) + 1 for s in seqs.values() if s), default=0)
    for call in range(start, end):
        at = {r: seqs[r].get(call) for r in members}
        if channel is not None:
            sender, receiver = at[channel[0]], at[channel[1]]
            same = (
                sender is not None
                and receiver is not None
                and sender.op == "send"
                and receiver.op == "recv"
                and (sender.shape is None or receiver.shape is None or sender.shape == receiver.shape)
            )
        else:
            sigs = {None if e is None else e.signature() for e in at.values()}
            same = len(sigs) == 1 and None not in sigs
        if same:
            continue
        groups: dict = defaultdict(list)
        for r, e in at.items():
            groups[None if e is None else (e.signature(), e.shape if channel is not None else None)].append(r)
        # the odd ones out first, ranks without the call last
        sides = sorted(
            ((tuple(rs), at[rs[0]]) for rs in groups.values()), key=lambda s: (s[1] is None, len(s[0]), s[0])
        )
        order = min(e.seq for e in at.values() if e is not None)
        return Divergence(group, call, tuple(sides), order, channel)
    return None


def diagnose(dumps) -> list[Divergence]:
    """Every stream's first divergence, earliest first (by the smallest call number involved).

    Args:
        dumps: ``{global rank: entries}`` (:func:`load_dumps`) or a directory of dumps.

    Returns:
        One :class:`Divergence` per group or P2P channel whose ranks disagree; empty when the
        records agree wherever they overlap.
    """
    if isinstance(dumps, (str, os.PathLike)):
        dumps = load_dumps(os.fspath(dumps))
    found = [
        d for key, per_rank in _streams(dumps).items() if (d := _first_divergence(key, per_rank, dumps)) is not None
    ]
    return sorted(found, key=lambda d: d.order)


def format_report(dumps, world_size: int | None = None) -> str:
    """A human-readable report: the first divergence, then the others; or that none was found.

    Args:
        dumps: ``{global rank: entries}`` (:func:`load_dumps`) or a directory of dumps.
        world_size: the job's ranks; when given, the ranks that wrote no record are named last
            (killed, aborted, or stopped answering before they could write one).
    """
    if isinstance(dumps, (str, os.PathLike)):
        dumps = load_dumps(os.fspath(dumps))
    found = diagnose(dumps)
    if not found:
        lines = [f"flight recorder: no divergence in the records of ranks {sorted(dumps)}"]
    else:
        lines = [f"flight recorder: ranks diverged first here: {found[0].describe()}"]
        lines += [f"  also: {d.describe()}" for d in found[1:]]
    missing = [r for r in range(world_size or 0) if r not in dumps]
    if missing:
        lines.append(
            f"flight recorder: no record from rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))} (killed, aborted, or stopped answering before writing one)"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shardkit.comm.flight_recorder DUMP_DIR", file=sys.stderr)
        return 2
    print(format_report(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
