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
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from types import TracebackType
from typing import NamedTuple

__all__ = [
    "INTERVAL_S",
    "GRACE_S",
    "Beat",
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
# Once the job is ending, a rank silent this long is not shutting down: it is stopped.
GRACE_S = 5.0


class Beat(NamedTuple):
    """One rank's heartbeat file: the wall time of its last beat (seconds), its pid, and whether
    it has left its run (the rank is exiting: not beating any more is no sign of a stall)."""

    time: float
    pid: int
    exiting: bool


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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardkit-heartbeat-rank{rank}", daemon=True)

    def _write(self, exiting: bool = False) -> None:
        """Write the file atomically (a reader never sees a half-written one)."""
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{self._last:.3f} {os.getpid()}{' exiting' if exiting else ''}\n")
        os.replace(tmp, self.path)

    def beat(self) -> None:
        """Write one beat."""
        self._last = time.time()
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError:
                return  # the directory was removed (the launcher is cleaning up): nothing to report to

    def __enter__(self) -> Heartbeat:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.beat()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
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
            beats[int(m.group(1))] = Beat(float(fields[0]), int(fields[1]), fields[2:] == ["exiting"])
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


def to_stop(beats: dict[int, Beat], alive: set[int], now: float, timeout_s: float) -> set[int]:
    """The ranks the launcher should kill now: alive, not exiting, and silent (pure).

    * While every rank runs: a rank whose last beat lags the newest by more than ``timeout_s``
      (it has been silent for longer than any collective waits for it, while the others ran).
    * Once a rank has left (failed, exiting, or gone): a rank silent for :data:`GRACE_S`. The
      launcher stops the others with SIGTERM and waits 30 s for each; a stopped process does not
      act on SIGTERM until continued, so without this the job would outlive the timeout by 30 s.

    Args:
        beats: from :func:`read_heartbeats`.
        alive: ranks whose process still runs.
        now: the wall time (``time.time()``).
        timeout_s: the run's process-group timeout.
    """
    running = {r: b for r, b in beats.items() if r in alive and not b.exiting}
    if not running:
        return set()
    if len(running) < len(beats):  # someone left: the job is ending
        return {r for r, b in running.items() if now - b.time > GRACE_S}
    newest = max(b.time for b in running.values())
    return {r for r, b in running.items() if newest - b.time > timeout_s}


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
    """In the launcher: every second, kill (SIGKILL) the ranks :func:`to_stop` names.

    A rank is killed only when it stays named for two checks in a row at least ``2 * INTERVAL_S``
    apart (a machine that was suspended resumes its ranks one after the other), and only if its
    pid is a child of this process.

    Args:
        directory: the flight directory the ranks beat into.
        timeout_s: the run's process-group timeout.
    """

    def __init__(self, directory: str, timeout_s: float) -> None:
        self.directory, self.timeout_s = directory, timeout_s
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardkit-watchdog", daemon=True)

    def _run(self) -> None:
        named_since: dict[int, float] = {}
        while not self._stop.wait(INTERVAL_S):
            beats = read_heartbeats(self.directory)
            alive = {r for r, b in beats.items() if _alive(b.pid)}
            now = time.time()
            named = to_stop(beats, alive, now, self.timeout_s)
            named_since = {r: named_since.get(r, now) for r in named}
            for r in named:
                if now - named_since[r] >= 2 * INTERVAL_S and r not in self.killed and _is_child(beats[r].pid):
                    self.killed.append(r)
                    os.kill(beats[r].pid, signal.SIGKILL)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


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
