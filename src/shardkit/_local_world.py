"""The privacy of a local launch: its run directory, its rendezvous, and loopback-only sockets.

torch's standalone launch hosts a TCPStore on every interface (the rendezvous, and then the
workers' store, sharing one port), unauthenticated and holding a pickled rendezvous state: anyone
who reaches the port can make the launcher unpickle their bytes. A shardkit launch instead keeps
everything in one private run directory (:func:`private_run_dir`: ``mkdtemp``, mode 0700,
removed afterwards): the rendezvous is a ``FileStore`` in it (with torch's shared TCPStore turned
off: :func:`no_shared_tcp_store`), so is the workers' store (:func:`init_local_world`), and so are
the launch's temporary files (:func:`private_temp`); gloo's own connections are bound to the
loopback interface.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from .errors import ShardkitError

__all__ = ["private_run_dir", "loopback_interface", "init_local_world", "no_shared_tcp_store", "private_temp"]

# torch's own switch (read by its dynamic rendezvous when the rendezvous completes): "1" stops
# the agent from starting a TCPStore server for the workers to share.
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

_RUN_PREFIX = "shardkit-run-"


@contextmanager
def private_run_dir() -> Iterator[str]:
    """A directory for one local launch that only this user can use, removed afterwards.

    ``tempfile.mkdtemp`` creates it with mode 0700, owned by this user, under a fresh random name
    (never a shared, guessable path) that starts with the launcher's pid. It holds the rendezvous
    and workers' stores and, without ``--report``, the flight records; it is removed however the
    launch ends (success, failure, SIGINT / SIGTERM). A SIGKILLed launcher cannot remove its
    own: the next launch removes the directories of launchers that no longer run
    (:func:`_remove_orphaned_run_dirs`).

    Yields:
        The directory's path.
    """
    _remove_orphaned_run_dirs(tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_orphaned_run_dirs(temp: str) -> None:
    """Remove the run directories in ``temp`` of this user's launchers that no longer run (a
    SIGKILLed launcher's). Only real directories owned by this user are touched (``lstat``: a
    symlink is never followed); a pid that runs again, reused by another process, keeps its
    directory (the safe side)."""
    try:
        names = [n for n in os.listdir(temp) if n.startswith(_RUN_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_RUN_PREFIX) :].split("-", 1)[0]
        path = os.path.join(temp, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not pid.isdigit() or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _runs(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _runs(pid: int) -> bool:
    """A process with this pid exists (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS and BSD).

    Raises:
        ShardkitError: neither exists (a local launch would then listen on another interface).
    """
    names = {name for _, name in socket.if_nameindex()}
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise ShardkitError(
        f"local launch: no loopback interface (lo or lo0) among {sorted(names)}; a local run "
        "binds its connections to loopback only"
    )


def init_local_world(run_dir: str, timeout: timedelta, rank: int | None = None, world_size: int | None = None) -> None:
    """Join the gloo world of a local launch, through a ``FileStore`` in the private ``run_dir``.

    Called in each worker of :func:`launch_local` instead of ``init_process_group("gloo")``
    (``env://`` would start a TCPStore server on every interface at ``MASTER_PORT``). gloo's
    connections between the ranks bind the address the host name resolves to, which is often a
    LAN address: ``GLOO_SOCKET_IFNAME`` (torch's own variable, set in this worker process only)
    pins them to the loopback interface.

    Args:
        run_dir: the launch's :func:`private_run_dir`.
        timeout: the process group's timeout (every collective, and every subgroup's:
            :meth:`shardkit.ParallelDims.build_mesh`).
        rank: this process's rank; None: torch elastic's ``RANK``.
        world_size: this process's world size; None: torch elastic's ``WORLD_SIZE``.
    """
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    store = dist.FileStore(os.path.join(run_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


@contextmanager
def no_shared_tcp_store() -> Iterator[None]:
    """Set torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the launch, then restore it.

    Even with a file rendezvous, torch's agent starts a TCPStore server on every interface for its
    workers to share, unless this variable is set when the rendezvous completes (torch reads it
    with ``os.getenv`` there, so it must be in the launcher's own environment). The workers use
    their own ``FileStore`` (:func:`init_local_world`) and never connect to that port.
    """
    previous = os.environ.get(_NO_SHARED_STORE)
    os.environ[_NO_SHARED_STORE] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_NO_SHARED_STORE, None)
        else:
            os.environ[_NO_SHARED_STORE] = previous


@contextmanager
def private_temp(run_dir: str) -> Iterator[None]:
    """Temporary files of the launch inside ``run_dir``, for the launch only (then restored).

    torch.multiprocessing names each worker's error file (a pickle the launcher loads if the
    worker fails) in the temporary directory, deletes it and lets the worker create it again; in
    a shared ``/tmp`` another user could plant it first. torch's elastic agent also leaves a log
    directory there per launch. ``tempfile.tempdir`` (this process) and ``TMPDIR`` (inherited by
    the workers) point into the private directory instead, so nothing is left behind either.
    """
    temp = os.path.join(run_dir, "tmp")
    os.makedirs(temp, mode=0o700, exist_ok=True)
    previous, previous_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = temp, temp
    try:
        yield
    finally:
        tempfile.tempdir = previous
        if previous_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous_env
