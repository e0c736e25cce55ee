"""Heartbeats of the ranks of ``shardkit train``, and which ranks stopped answering.

A rank that is stopped (SIGSTOP, a debugger, a machine that swaps itself to death) does not fail:
its peers wait for it inside a collective until the process-group timeout (``--timeout``) and
then fail themselves, each with a timeout error. Their errors are real but secondary; the rank to
look at is the one that went quiet. Each rank therefore runs a daemon thread that writes the wall
time into ``<flight dir>/heartbeat-rank<r>`` every :data:`INTERVAL_S` seconds (a thread keeps
beating while its rank waits in a collective, which releases the GIL; a stopped process does
not). In the launcher a :class:`~.watchdog.Watchdog` kills a rank that went silent
(:func:`~.watchdog.to_stop`), so that a stopped rank ends the job within about the timeout;
after a failed launch :func:`~.watchdog.stalled_ranks` names the ranks whose last beat is far
older than the others', and the launcher names them first.

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
import sys
import threading
import time
from types import TracebackType
from typing import NamedTuple

from .._moved import moved_names

__all__ = [
    "INTERVAL_S",
    "FIRST_BEAT_S",
    "PHASES",
    "Beat",
    "set_phase",
    "progress",
    "Heartbeat",
    "read_heartbeats",
    "clear_flight_dir",
]

INTERVAL_S = 1.0
_BEAT = re.compile(r"^heartbeat-rank(\d+)$")
_DUMP = re.compile(r"^rank(\d+)\.json(\.tmp\d+)?$")
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


class Heartbeat:
    """Write this rank's wall time (``time.time()``, seconds) to ``directory/heartbeat-rank<rank>``
    every ``interval`` seconds from a daemon thread, while the context is open; on leaving it,
    mark the file ``exiting``, with the time it left (the last sign of life: a rank that fails
    after waiting for a stopped peer is then seen alive until it failed, however late its thread's
    last beat was on a loaded machine; :func:`~.watchdog.stalled_ranks` compares these times).

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
        self._last = time.time()
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


# The watchdog moved to .watchdog (this module was over the file-size limit): the old names still
# resolve, with a DeprecationWarning, for one release.
__getattr__ = moved_names(
    __name__, dict.fromkeys(("Verdict", "stalled_ranks", "to_stop", "Watchdog"), "shardkit.train.watchdog")
)
