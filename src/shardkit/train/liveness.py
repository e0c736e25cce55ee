"""Heartbeats of the ranks of ``shardkit train``, and which ranks stopped answering.

A rank that is stopped (SIGSTOP, a debugger, a machine that swaps itself to death) does not fail:
its peers wait for it inside a collective until the process-group timeout (``--timeout``) and
then fail themselves, each with a timeout error. Their errors are real but secondary; the rank to
look at is the one that went quiet. Each rank therefore runs a daemon thread that writes the wall
time into ``<flight dir>/heartbeat-rank<r>`` every :data:`INTERVAL_S` seconds (a thread keeps
beating while its rank waits in a collective, which releases the GIL; a stopped process does
not). In the launcher a :class:`Watchdog` kills a rank that went silent (:func:`to_stop`), so that
a stopped rank ends the job within about the timeout; after a failed launch
:func:`stalled_ranks` names the ranks whose last beat is far older than the others', and the
launcher names them first.

The files are written next to the flight recorder's dumps (``rank<r>.json``), and both are
cleared at launch (:func:`clear_flight_dir`), so an earlier run's records never enter a new
diagnosis.

The watchdog judges progress, not a thread's punctuality (a heartbeat thread can miss its beats
for many seconds on a saturated machine while its rank works). Each beat carries the *phase* the
rank is in (:data:`PHASES`: ``starting``, ``training``, ``evaluating``, ``saving``, ``exporting``,
``loading``, ``finishing``) and a *progress counter*: the rank's explicit :func:`progress` calls
(each step, each file written, each phase entered) plus the shardkit collectives its flight
recorder counted. A rank is stalled only when that counter has not moved for ``--timeout``
seconds, in any phase; rank 0's solo work after the others exit (gather, ``--save-hf``, the
report) is the phase ``finishing`` with the same deadline. Every kill is announced on stderr
("shardkit's watchdog stopped rank R: no progress for N s in phase P"); a rank that never sent
its first heartbeat is named as such; and when every rank stalls together (all of them at 100 %
CPU with the GIL held, say) they are all stopped, so the job still ends within about the timeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from types import TracebackType
from typing import NamedTuple

__all__ = [
    "INTERVAL_S",
    "FIRST_BEAT_S",
    "PHASES",
    "Beat",
    "Verdict",
    "set_phase",
    "progress",
    "Heartbeat",
    "read_heartbeats",
    "stalled_ranks",
    "to_stop",
    "Watchdog",
    "clear_flight_dir",
]

INTERVAL_S = 1.0
_BEAT = re.compile(r"^heartbeat-rank(\d+)$")
_DUMP = re.compile(r"^rank(\d+)\.json(\.tmp\d+)?$")
# A healthy rank's beats may lag by a few intervals on a loaded machine; a stalled rank's lag the
# others' last beats by about the process-group timeout (they time out waiting for it).
_MIN_LAG_S = 3 * INTERVAL_S
# A rank's first beat may come this late (seconds; or ``--timeout``, if longer): starting a worker
# imports torch, which takes tens of seconds on a saturated machine.
FIRST_BEAT_S = 30.0

PHASES = ("starting", "training", "evaluating", "saving", "exporting", "loading", "finishing")

# This process's phase and progress counter, read by its Heartbeat thread (plain attributes: a
# torn read costs one beat's accuracy, never a crash).
_phase = "starting"
_count = 0
_active: Heartbeat | None = None  # the open Heartbeat of this process: a new phase is written at once


def set_phase(name: str) -> None:
    """Say that this rank entered phase ``name`` (one of :data:`PHASES`); entering a phase is progress.

    Raises:
        ValueError: an unknown phase.
    """
    global _phase
    if name not in PHASES:
        raise ValueError(f"set_phase: unknown phase {name!r}; expected one of {', '.join(PHASES)}")
    changed, _phase = name != _phase, name
    progress()
    if changed and _active is not None:  # the watchdog names the phase the rank is really in
        with contextlib.suppress(OSError):
            _active.beat()


def progress(n: int = 1) -> None:
    """Count ``n`` units of progress of this rank (a step, a file written): the watchdog stops a
    rank only when its count has not moved for ``--timeout`` seconds."""
    global _count
    _count += n


def _collectives() -> int:
    """The shardkit collectives this process's flight recorder counted (0 when disabled, or not
    imported: a beat never imports torch, which takes seconds on a loaded machine)."""
    module = sys.modules.get("shardkit.comm.flight_recorder")
    recorder = getattr(module, "current", None)
    return recorder.total if recorder is not None else 0


class Beat(NamedTuple):
    """One rank's heartbeat file: the wall time of its last beat (seconds), its pid, whether it
    has left its run (the rank is exiting: not beating any more is no sign of a stall), its phase,
    and the wall time its progress counter last moved (a file of an older release: its beat time)."""

    time: float
    pid: int
    exiting: bool
    phase: str = "starting"
    progressed: float | None = None

    @property
    def moved(self) -> float:
        """The wall time this rank last made progress."""
        return self.time if self.progressed is None else self.progressed


class Verdict(NamedTuple):
    """Why the watchdog stops a rank: ``seconds`` without progress (or without any heartbeat,
    ``never_beat``) in ``phase``."""

    seconds: float
    phase: str
    never_beat: bool = False

    def describe(self, rank: int) -> str:
        """The line the watchdog announces on stderr."""
        if self.never_beat:
            return (
                f"shardkit's watchdog stopped rank {rank}: rank {rank} sent no heartbeat in "
                f"{self.seconds:.0f} s (phase {self.phase})"
            )
        return f"shardkit's watchdog stopped rank {rank}: no progress for {self.seconds:.0f} s in phase {self.phase}"


class Heartbeat:
    """Write this rank's wall time (``time.time()``, seconds) to ``directory/heartbeat-rank<rank>``
    every ``interval`` seconds from a daemon thread, while the context is open; on leaving it,
    mark the file ``exiting`` (the last beat's time is kept).

    Args:
        directory: the run's flight directory (created if missing).
        rank: this rank's global rank.
        interval: seconds between beats (> 0).
    """

    def __init__(self, directory: str, rank: int, interval: float = INTERVAL_S) -> None:
        self.path = os.path.join(directory, f"heartbeat-rank{rank}")
        self.interval = interval
        self._last = time.time()
        self._seen = -1  # the progress count at the last beat
        self._moved = self._last
        self._lock = threading.Lock()  # the thread's beats and set_phase's share one temporary file
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardkit-heartbeat-rank{rank}", daemon=True)

    def _write(self, exiting: bool = False) -> None:
        """Write the file atomically (a reader never sees a half-written one)."""
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{self._last:.3f} {os.getpid()} {_phase} {self._moved:.3f}{' exiting' if exiting else ''}\n")
        os.replace(tmp, self.path)

    def beat(self) -> None:
        """Write one beat (with the time the progress counter last moved)."""
        with self._lock:
            self._last = time.time()
            count = _count + _collectives()
            if count != self._seen:
                self._seen, self._moved = count, self._last
            self._write()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError:
                return  # the directory was removed (the launcher is cleaning up): nothing to report to

    def __enter__(self) -> Heartbeat:
        global _active
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.beat()
        self._thread.start()
        _active = self
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _active
        if _active is self:
            _active = None
        self._stop.set()
        self._thread.join()
        try:
            self._write(exiting=True)
        except OSError:
            pass  # the directory is gone: nobody is watching


def read_heartbeats(directory: str) -> dict[int, Beat]:
    """``{rank: its Beat}`` from the heartbeat files in ``directory`` (empty if none)."""
    beats: dict[int, Beat] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return beats
    for name in names:
        if (m := _BEAT.match(name)) is None:
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                fields = f.read().split()
            exiting = fields[-1:] == ["exiting"]
            rest = fields[2 : len(fields) - exiting]
            phase, moved = (rest[0], float(rest[1])) if len(rest) == 2 else ("starting", None)
            beats[int(m.group(1))] = Beat(float(fields[0]), int(fields[1]), exiting, phase, moved)
        except (OSError, ValueError, IndexError):
            continue  # unreadable: that rank is simply not known
    return beats


def stalled_ranks(beats: dict[int, Beat], timeout_s: float) -> dict[int, float]:
    """The ranks that stopped answering: ``{rank: seconds its last beat lags the newest one}``.

    A rank is stalled when its last beat is older than the newest rank's last beat by more than
    ``max(3 beats, timeout_s / 2)``: when a rank stops, the others keep beating until they time
    out waiting for it, about ``timeout_s`` later (pure; sorted by rank).

    Args:
        beats: from :func:`read_heartbeats`.
        timeout_s: the run's process-group timeout (``--timeout``), seconds.
    """
    if len(beats) < 2:
        return {}
    newest = max(b.time for b in beats.values())
    limit = max(_MIN_LAG_S, timeout_s / 2)
    return {r: round(newest - b.time, 1) for r, b in sorted(beats.items()) if newest - b.time > limit}


def to_stop(
    beats: dict[int, Beat],
    alive: set[int],
    now: float,
    timeout_s: float,
    nproc: int | None = None,
    started: float | None = None,
) -> dict[int, Verdict]:
    """The ranks the launcher should kill now, each with its :class:`Verdict` (pure).

    * A rank (of ``range(nproc)``) with no heartbeat file ``max(timeout_s, FIRST_BEAT_S)`` seconds
      after the launch (``started``): it never started its run. Only these are named then, and
      until then nobody is: the ranks that did start are waiting for it.
    * Otherwise a rank alive and not exiting whose progress has not moved for ``timeout_s``,
      whatever its phase (alone after the others exited, too: rank 0's ``finishing``). When some
      of the stalled ranks are also silent (their beats stopped when their progress did, within
      :data:`_MIN_LAG_S`: stopped, or holding the GIL), only those are named: the others are
      waiting for them in a collective. When every stalled rank still beats, all are named:
      nothing tells which one waits for which.

    Args:
        beats: from :func:`read_heartbeats`.
        alive: ranks whose process still runs.
        now: the wall time (``time.time()``).
        timeout_s: the run's process-group timeout (``--timeout``).
        nproc: the ranks launched (None: only the ranks that beat are judged).
        started: the wall time of the launch (with ``nproc``).
    """
    missing = [r for r in range(nproc) if r not in beats] if nproc is not None else []
    if missing and started is not None:  # the ranks that did start may be waiting for them
        waited = now - started
        if waited <= max(timeout_s, FIRST_BEAT_S):
            return {}
        return {r: Verdict(round(waited, 1), "starting", never_beat=True) for r in missing}
    running = {r: b for r, b in beats.items() if r in alive and not b.exiting}
    stalled = {r: b for r, b in running.items() if now - b.moved > timeout_s}
    # silent: its beats stopped (about) when its progress did; a rank waiting in a collective beat
    # on long after its progress stopped, even when its thread is late on a loaded machine
    silent = {r: b for r, b in stalled.items() if now - b.time > max(_MIN_LAG_S, now - b.moved - _MIN_LAG_S)}
    return {r: Verdict(round(now - b.moved, 1), b.phase) for r, b in sorted((silent or stalled).items())}


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): signal 0 tells whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class Watchdog:
    """In the launcher: every second, kill (SIGKILL) the ranks :func:`to_stop` names, announcing
    each on stderr (:meth:`Verdict.describe`); ``stopped`` keeps ``{rank: its Verdict}``.

    Ranks are killed only when one of them stays named for two checks in a row at least
    ``2 * INTERVAL_S`` apart (a machine that was suspended resumes its ranks one after the other);
    then every rank named in that check is, if its pid is a child of this process. A rank that
    never beat has no pid on file: the launcher's worker processes that no heartbeat names are
    killed (Linux); where they cannot be found, the ranks that did start are, so that the job
    ends either way.

    Args:
        directory: the flight directory the ranks beat into.
        timeout_s: the run's process-group timeout.
        nproc: the ranks launched (None: only the ranks that beat are judged).
    """

    def __init__(self, directory: str, timeout_s: float, nproc: int | None = None) -> None:
        self.directory, self.timeout_s, self.nproc = directory, timeout_s, nproc
        self.killed: list[int] = []
        self.stopped: dict[int, Verdict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardkit-watchdog", daemon=True)

    def _run(self) -> None:
        named_since: dict[int, float] = {}
        started = time.time()
        while not self._stop.wait(INTERVAL_S):
            beats = read_heartbeats(self.directory)
            alive = {r for r, b in beats.items() if _alive(b.pid)}
            now = time.time()
            named = to_stop(beats, alive, now, self.timeout_s, self.nproc, started)
            named_since = {r: named_since.get(r, now) for r in named}
            if not any(now - t >= 2 * INTERVAL_S for t in named_since.values()):
                continue
            # one rank confirmed: every rank named now goes with it (ranks stalled together)
            ready = {
                r: v for r, v in named.items() if r not in self.killed and (v.never_beat or _is_child(beats[r].pid))
            }
            if not ready:
                continue
            if any(v.never_beat for v in ready.values()):
                pids = _unnamed_workers({b.pid for b in beats.values()})
                if not pids:  # not found: stop the ranks that wait for it
                    pids = [b.pid for r, b in beats.items() if r in alive and _is_child(b.pid)]
            else:
                pids = [beats[r].pid for r in ready]
            for r, verdict in ready.items():
                self.killed.append(r)
                self.stopped[r] = verdict
                print(verdict.describe(r), file=sys.stderr, flush=True)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _unnamed_workers(named: set[int]) -> list[int]:
    """The pids of this process's worker children (started by multiprocessing's spawn) that are
    not in ``named`` (Linux /proc; elsewhere none are found)."""
    pids = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        return []
    out = []
    for pid in sorted(set(pids) - named):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read() and _alive(pid):
                    out.append(pid)
        except OSError:
            continue
    return out


def _is_child(pid: int) -> bool:
    """``pid``'s parent is this process (Linux /proc; elsewhere assumed: the pid came from a rank's
    heartbeat file in this user's own directory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def clear_flight_dir(directory: str, rank: int | None = None) -> None:
    """Remove the flight dumps and heartbeats of an earlier run from ``directory`` (only those
    files; every rank's, or ``rank``'s alone: under torchrun each rank clears its own)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        m = _BEAT.match(name.removesuffix(".tmp")) or _DUMP.match(name)
        if m is not None and (rank is None or int(m.group(1)) == rank):
            os.remove(os.path.join(directory, name))
