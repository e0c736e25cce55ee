"""One writer per checkpoint root: ``ROOT/.lock``, created with ``O_CREAT | O_EXCL``.

The lock file holds JSON ``{"run_id", "host", "pid", "start"}`` (``start``: the process's start
time from ``/proc``, so a recycled pid is not mistaken for the holder). Rank 0 of the run takes
it before anything reads or writes the root and removes it when the run ends (success or
failure); every rank learns the outcome from rank 0, so a refused lock is one error on every
rank. A lock whose process is gone (same host, pid dead or recycled) is taken over with a
message; a live one, or one of another host (whose processes cannot be checked from here), is
refused naming its run id, host and pid.

Source: the ``O_EXCL`` lock files of POSIX tools (e.g. Git's ``index.lock``) with the holder's
pid and host, as in ``lockfile``/``fasteners``-style stale-lock detection.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..comm._group import resolve_group
from ..errors import ShardkitError
from .versioned import broadcast_from_first

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["LOCK", "REPORT_LOCK", "root_lock", "process_lock", "lock_holder", "holder_alive", "link_lock"]

LOCK = ".lock"
REPORT_LOCK = ".report.lock"  # --report DIR's (DIR may be the --checkpoint-dir too: another file)
# what two holders of a lock would do to each other, and the flag to change: said when refused
_CLASH = {
    LOCK: ("the checkpoint directory", "two runs would replace each other's saves", "--checkpoint-dir"),
    REPORT_LOCK: (
        "the report directory",
        "two runs would interleave metrics.jsonl and overwrite report.json",
        "--report",
    ),
}


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state first), [] where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks since boot), None where unknown."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None


def lock_holder(root: str, name: str = LOCK) -> dict | None:
    """The holder recorded in ``root``'s lock (file ``name``), None without a lock; ``{}`` for an unreadable one."""
    try:
        with open(os.path.join(root, name)) as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def holder_alive(holder: dict) -> bool:
    """Whether the holder may still run: False only when it is of this host and its pid is gone
    (or now belongs to a process started at another time)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    fields = _stat(holder["pid"])
    if fields and fields[0] in ("Z", "X"):
        return False  # exited, not yet reaped (a container's init may never reap it)
    start = fields[19] if len(fields) > 19 else None
    return holder.get("start") is None or start is None or start == holder["start"]


def describe(holder: dict) -> str:
    if not holder:
        return "an unreadable lock (being written, or damaged)"
    return f"run {holder.get('run_id')} (pid {holder.get('pid')} on host {holder.get('host')})"


def _create(path: str, holder: dict) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(holder, f)
    return True


def _acquire(root: str, holder: dict, name: str = LOCK) -> tuple[str | None, str | None]:
    """Rank 0: (error, message) of taking ``root``'s lock (file ``name``) for ``holder``."""
    what, clash, flag = _CLASH[name]
    try:
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, name)
        if os.path.islink(path):  # O_EXCL never creates through it, and reading it finds no holder
            return link_lock(path), None
        if _create(path, holder):
            return None, None
        found = lock_holder(root, name)
        if found is None:  # released between the two calls
            return (None, None) if _create(path, holder) else (f"{path}: the lock changed hands; retry", None)
        if found and found.get("pid") == holder["pid"] and found.get("host") == holder["host"]:
            return f"{path} is already held by this process ({describe(found)})", None
        if not found or holder_alive(found):
            return (
                f"{what} {root} is in use by {describe(found)}: {clash}. Wait for it to end, choose another "
                f"{flag}, or remove {path} if no such run exists"
            ), None
        os.remove(path)
        if not _create(path, holder):
            return f"{path}: another run took the stale lock first", None
        return None, f"shardkit: took over the stale lock of {describe(found)}, which is no longer running"
    except OSError as exc:
        return f"cannot lock {what} {root}: {exc.strerror or exc}", None


def link_lock(path: str) -> str:
    """Why a lock file that is a symbolic link is refused (dangling or not: shardkit writes a file)."""
    return (
        f"{path} is a symbolic link (to {os.readlink(path)!r}), not a lock shardkit wrote: no run can take "
        "the lock while it is there; remove it if no run is using the directory"
    )


def _release(root: str, holder: dict, name: str = LOCK) -> None:
    """Rank 0: remove the lock if it is still this run's."""
    found = lock_holder(root, name)
    if found and found.get("run_id") == holder["run_id"]:
        try:
            os.remove(os.path.join(root, name))
        except OSError:
            pass  # already gone, or the directory went read-only: the next run sees a dead pid


@contextmanager
def root_lock(
    root: str | os.PathLike, group: Group, op: str, reuse: bool = False, verify: Callable[[str], None] | None = None
):
    """Collective over ``group`` (on entry): hold ``root``'s lock inside the ``with`` block.

    Args:
        root: the checkpoint root (created when missing).
        group: every rank of the run; rank 0 takes and releases the lock.
        op: named in errors.
        reuse: when this process already holds the lock (a save inside a locked run), use it
            and leave it held.
        verify: ``fn(root)``, run by rank 0 once the lock is taken: the directory checked again
            now that no other run can change it (what was checked before launch may have
            changed since); a ``ShardkitError`` it raises releases the lock and is raised on
            every rank.

    Raises:
        ShardkitError: on every rank: another live run (or another host's) holds it, it
            cannot be created, ``.lock`` is a symbolic link, or ``verify`` refused the directory.
    """
    g = resolve_group(group, op)
    root = os.path.abspath(os.fspath(root))
    holder = {
        "run_id": uuid.uuid4().hex[:12],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
    }
    owned: tuple[str | None, str | None] = (None, None)
    if g.rank == 0:
        found = lock_holder(root) if reuse else None
        if found and found.get("pid") == holder["pid"] and found.get("host") == holder["host"]:
            owned = (None, "reused")
        else:
            owned = _acquire(root, holder)
            if owned[0] is None and verify is not None:
                try:
                    verify(root)
                except ShardkitError as exc:
                    _release(root, holder)
                    owned = (f"{exc} (checked again once the lock was taken)", None)
    error, message = broadcast_from_first(group, owned)
    if error:
        raise ShardkitError(f"{op}: {error}")
    if message and message != "reused" and g.rank == 0:
        print(message, file=sys.stderr)
    try:
        yield
    finally:
        if g.rank == 0 and message != "reused":
            _release(root, holder)


@contextmanager
def process_lock(root: str | os.PathLike, op: str, name: str = REPORT_LOCK):
    """One process, no group: hold ``root``'s lock file ``name`` inside the ``with`` block (the
    same lock as :func:`root_lock`: a live holder refused, a dead one's taken over with a message).

    Raises:
        ShardkitError: another live run (or another host's) holds it, or it cannot be created.
    """
    root = os.path.abspath(os.fspath(root))
    pid = os.getpid()
    holder = {"run_id": uuid.uuid4().hex[:12], "host": socket.gethostname(), "pid": pid, "start": _start_time(pid)}
    error, message = _acquire(root, holder, name)
    if error:
        raise ShardkitError(f"{op}: {error}")
    if message:
        print(message, file=sys.stderr)
    try:
        yield
    finally:
        _release(root, holder, name)
