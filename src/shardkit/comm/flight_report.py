"""Reading flight recorder dumps (:mod:`.flight_recorder`): which call the ranks parted at.

:func:`diagnose` compares every rank's dumped entries: per process group, entry ``i`` of every
member must be the same op, api and phase; per directed P2P channel, send ``i`` of the sender
must meet recv ``i`` of the receiver with the same shape. The first entry where they differ is
reported with the ranks on each side (:func:`format_report`;
``python -m shardkit.comm.flight_recorder DUMP_DIR``).

Source: PyTorch's NCCL flight recorder analysis (``fr_trace``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

__all__ = ["FlightEntry", "Divergence", "Wait", "load_dumps", "diagnose", "waited_for", "format_report", "main"]

P2P_OPS = ("send", "recv")


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
        src: for P2P, the sender's group rank.
        dst: for P2P, the receiver's group rank.
        time: wall-clock time (``time.time()``, seconds) when this rank entered the call; None in
            dumps of releases before it was recorded.
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
    time: float | None = None

    def describe(self) -> str:
        shape = f" {list(self.shape)}" if self.shape is not None else ""
        peer = ""
        if self.op in P2P_OPS and self.peer is not None and self.group is not None:
            peer = f" {'to' if self.op == 'send' else 'from'} rank {self.group[self.peer]}"
        return f"{self.op}{shape}{peer} in {self.api} {self.phase}"

    def signature(self):
        """What every member of a group stream must agree on."""
        return (self.op, self.api, self.phase)


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


@dataclass(frozen=True)
class Wait:
    """Ranks that sat in a call waiting for one that came late or never came.

    Attributes:
        late: the global rank the others waited for.
        waiting: the global ranks that had entered the call.
        seconds: how long after the first of them ``late`` entered it; None when it never did.
        entry: the call, as the first waiting rank recorded it.
    """

    late: int
    waiting: tuple
    seconds: float | None
    entry: FlightEntry

    def describe(self) -> str:
        who = f"rank{'s' if len(self.waiting) > 1 else ''} {', '.join(map(str, self.waiting))}"
        when = "had not reached it" if self.seconds is None else f"entered it {self.seconds:.1f} s after them"
        return f"{who} waited for it in {self.entry.describe()} (call {self.entry.group_seq}); rank {self.late} {when}"


def waited_for(dumps, min_wait_s: float) -> list[Wait]:
    """Who waited for whom at the end of the records: per stream (group or P2P channel), the last
    call any member entered, and the members that entered it more than ``min_wait_s`` after the
    first one or not at all. The root of the wait first (a late rank not itself waiting in another
    stream), then the most recent.

    Needs entry times (:attr:`FlightEntry.time`); a stream without them is skipped. Where only a
    rank that failed by itself lacks the call, it is named too: the caller decides, from the ranks'
    errors, whether a wait or an error is the cause.

    Args:
        dumps: ``{global rank: entries}`` (:func:`load_dumps`) or a directory of dumps.
        min_wait_s: seconds of lateness that count as waiting (e.g. half the process-group timeout).
    """
    if isinstance(dumps, (str, os.PathLike)):
        dumps = load_dumps(os.fspath(dumps))
    found = []
    for (_, group, channel), per_rank in _streams(dumps).items():
        members = [r for r in (channel if channel is not None else group) if r in dumps]
        last = max((max(per_rank[r]) for r in members if per_rank.get(r)), default=None)
        if len(members) < 2 or last is None:
            continue
        at = {r: per_rank.get(r, {}).get(last) for r in members}
        times = {r: e.time for r, e in at.items() if e is not None and e.time is not None}
        if not times:
            continue
        first = min(times.values())
        waiting = tuple(r for r in members if r in times and times[r] - first <= min_wait_s)
        entry = next(at[r] for r in waiting if times[r] == first)
        for r in members:
            if r not in waiting and (r in times or at[r] is None):
                found.append(Wait(r, waiting, round(times[r] - first, 1) if r in times else None, entry))
    # A late rank that itself waits elsewhere is a link of a chain (it waits in one group while its
    # other group waits for it): the ranks waiting nowhere come first, the root of the wait.
    waits_too = {r for w in found for r in w.waiting}
    return sorted(found, key=lambda w: (w.late in waits_too, -(w.entry.time or 0.0)))


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
