"""The launcher's watchdog over the ranks' heartbeats (:mod:`.liveness`): which ranks to stop,
and the thread that stops them.

It judges progress, not a heartbeat thread's punctuality: a rank is stalled only when its
progress counter has not moved for ``--timeout`` seconds, in any phase (:data:`.liveness.PHASES`).
Every kill is announced on stderr (:class:`Verdict`); a rank that never sent its first heartbeat
is named as such; when every rank stalls together with its beats stopped (the GIL held) they are
all stopped, so the job still ends within about the timeout, while ranks that all still beat
without progress are left alone (waiting in collectives, which time out by themselves, or slow).
After a failed launch :func:`stalled_ranks` names the ranks whose last beat is far older than the
others'.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import NamedTuple

from .liveness import FIRST_BEAT_S, INTERVAL_S, Beat, read_heartbeats

__all__ = ["Verdict", "stalled_ranks", "to_stop", "Watchdog", "parent_pid"]

# A healthy rank's beats may lag by a few intervals on a loaded machine; a stalled rank's lag the
# others' last beats by about the process-group timeout (they time out waiting for it).
_MIN_LAG_S = 3 * INTERVAL_S


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
      after the launch's first heartbeat (``started``): it never started its run. Only these are
      named then, and until then nobody is: the ranks that did start are waiting for it. While
      no rank has beaten, none is named (at load 100 importing torch takes over 30 s).
    * Otherwise a rank alive and not exiting whose progress has not moved for ``timeout_s``,
      whatever its phase, when it is also *silent* (its beats stopped when its progress did,
      within :data:`_MIN_LAG_S`: stopped, or holding the GIL; every rank at once, too: the hash
      bomb). Only the silent ones are named then: the others are waiting for them.
    * A stalled rank that still beats is named only when it is the odd one out: another running
      rank still progresses, or it runs alone (the others exited: rank 0's ``finishing`` has the
      same deadline). When every running rank is stalled and still beats, none is: they wait in
      collectives, which the process-group timeout ends by itself, or they compute slowly
      (building the model on a saturated machine): alive, never killed.

    Args:
        beats: from :func:`read_heartbeats`.
        alive: ranks whose process still runs.
        now: the wall time (``time.time()``).
        timeout_s: the run's process-group timeout (``--timeout``).
        nproc: the ranks launched (None: only the ranks that beat are judged).
        started: the wall time the first heartbeat of the launch was seen (with ``nproc``; the
            :class:`Watchdog` passes it): a rank is late against the ranks that did start, never
            against a machine on which every rank starts slowly.
    """
    missing = [r for r in range(nproc) if r not in beats] if nproc is not None else []
    if missing and started is not None:  # the ranks that did start may be waiting for them
        if not beats:  # nobody has beaten yet: every rank is still starting (import torch, at load 100)
            return {}
        waited = now - started
        if waited <= max(timeout_s, FIRST_BEAT_S):
            return {}
        return {r: Verdict(round(waited, 1), "starting", never_beat=True) for r in missing}
    running = {r: b for r, b in beats.items() if r in alive and not b.exiting}
    stalled = {r: b for r, b in running.items() if now - b.moved > timeout_s}
    # silent: its beats stopped (about) when its progress did; a rank waiting in a collective beat
    # on long after its progress stopped, even when its thread is late on a loaded machine
    silent = {r: b for r, b in stalled.items() if now - b.time > max(_MIN_LAG_S, now - b.moved - _MIN_LAG_S)}
    if not silent and len(stalled) == len(running) > 1:
        return {}  # every rank beats without progress: waiting (the process-group timeout) or slow
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
        started: float | None = None  # when the first heartbeat of the launch was seen
        while not self._stop.wait(INTERVAL_S):
            beats = read_heartbeats(self.directory)
            alive = {r for r, b in beats.items() if _alive(b.pid)}
            now = time.time()
            if started is None and beats:
                started = now
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
    """``pid`` is a worker of this process: its child (a spawned rank) or its child's (a rank
    forked by this launcher's forkserver: ``launch_local(preload=...)``). Linux /proc; elsewhere
    assumed: the pid came from a rank's heartbeat file in this user's own directory."""
    try:
        parent = parent_pid(pid)
        return parent == os.getpid() or parent_pid(parent) == os.getpid()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def parent_pid(pid: int) -> int:
    """The parent pid of ``pid`` from Linux ``/proc``; raises ``OSError`` where it cannot be read
    (``FileNotFoundError``: no such process)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
