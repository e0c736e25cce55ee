"""Heartbeats of the ranks of ``shardkit train``, and which ranks stopped answering.

A rank that is stopped (SIGSTOP, a debugger, a machine that swaps itself to death) does not fail:
its peers wait for it inside a collective until the process-group timeout (``--timeout``) and
then fail themselves, each with a timeout error. Their errors are real but secondary; the rank to
look at is the one that went quiet. Each rank therefore runs a daemon thread that writes the wall
time into ``<flight dir>/heartbeat-rank<r>`` every :data:`INTERVAL_S` seconds (a thread keeps
beating while its rank waits in a collective, which releases the GIL; a stopped process does
not). After a failed launch :func:`stalled_ranks` names the ranks whose last beat is far older
than the others', and the launcher names them first.

The files are written next to the flight recorder's dumps (``rank<r>.json``), and both are
cleared at launch (:func:`clear_flight_dir`), so an earlier run's records never enter a new
diagnosis.
"""

from __future__ import annotations

import os
import re
import threading
import time
from types import TracebackType

__all__ = ["INTERVAL_S", "Heartbeat", "read_heartbeats", "stalled_ranks", "clear_flight_dir"]

INTERVAL_S = 1.0
_BEAT = re.compile(r"^heartbeat-rank(\d+)$")
_DUMP = re.compile(r"^rank(\d+)\.json(\.tmp\d+)?$")
# A healthy rank's beats may lag by a few intervals on a loaded machine; a stalled rank's lag the
# others' last beats by about the process-group timeout (they time out waiting for it).
_MIN_LAG_S = 3 * INTERVAL_S


class Heartbeat:
    """Write this rank's wall time (``time.time()``, seconds) to ``directory/heartbeat-rank<rank>``
    every ``interval`` seconds from a daemon thread, while the context is open.

    Args:
        directory: the run's flight directory (created if missing).
        rank: this rank's global rank.
        interval: seconds between beats (> 0).
    """

    def __init__(self, directory: str, rank: int, interval: float = INTERVAL_S) -> None:
        self.path = os.path.join(directory, f"heartbeat-rank{rank}")
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardkit-heartbeat-rank{rank}", daemon=True)

    def beat(self) -> None:
        """Write one beat (atomically: a reader never sees a half-written file)."""
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{time.time():.3f} {os.getpid()}\n")
        os.replace(tmp, self.path)

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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()


def read_heartbeats(directory: str) -> dict[int, float]:
    """``{rank: wall time of its last beat}`` from the heartbeat files in ``directory`` (empty if none)."""
    beats: dict[int, float] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return beats
    for name in names:
        if (m := _BEAT.match(name)) is None:
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                beats[int(m.group(1))] = float(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # unreadable: that rank is simply not known
    return beats


def stalled_ranks(beats: dict[int, float], timeout_s: float) -> dict[int, float]:
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
    newest = max(beats.values())
    limit = max(_MIN_LAG_S, timeout_s / 2)
    return {r: round(newest - t, 1) for r, t in sorted(beats.items()) if newest - t > limit}


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
