"""The forked start of a local launch (``launch_local(preload=...)``): the forkserver's imports,
its start, and what a forked rank must take from the launcher that a spawned one inherits.

Why: on a loaded 2-core machine, four spawned ranks each importing torch, transformers' modeling
code and shardkit were most of the time to the first step (issue 32: 19 s of a 21 s set-up at
load 14); a forkserver imports them once and forks the ranks from there.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import tempfile
from collections.abc import Callable, Sequence

from ..train.watchdog import parent_pid

__all__ = [
    "take_launcher_env",
    "parent_of",
    "forkserver_preload",
    "start_forkserver",
    "make_forkserver_temp",
    "FORKSERVER_TEMP",
]

# The variables torch elastic sets for each rank (LocalElasticAgent, torch.multiprocessing): a
# rank keeps these from elastic, every other variable is the launcher's (take_launcher_env).
_ELASTIC_VARS = frozenset(
    "RANK LOCAL_RANK GROUP_RANK ROLE_RANK ROLE_NAME WORLD_SIZE LOCAL_WORLD_SIZE GROUP_WORLD_SIZE "
    "ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCH_NCCL_ASYNC_ERROR_HANDLING".split()
)


def take_launcher_env(env: dict[str, str]) -> None:
    """Give this rank the launcher's environment ``env`` (taken at launch), torch elastic's own
    variables kept.

    A forked rank starts with its forkserver's environment, which is the launcher's as it was
    when the forkserver started: a private ``TMPDIR`` (:func:`shardkit._local_world.private_temp`)
    or a variable set since then would be missing. Variables the forkserver has and ``env`` lacks are left (a
    spawned rank would not have them; none is known to matter).
    """
    for key, value in env.items():
        if key in _ELASTIC_VARS or key.startswith("TORCHELASTIC_"):
            continue
        os.environ[key] = value
    if "TMPDIR" in env:  # tempfile caches its directory: the forkserver may have asked already
        tempfile.tempdir = None


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (:func:`shardkit.train.watchdog.parent_pid`), None where that
    cannot be read."""
    try:
        return parent_pid(pid)
    except OSError:
        return None


def forkserver_preload(modules: Sequence[str], entry: Callable) -> list[str]:
    """The modules the forkserver imports before it forks any rank: first the guard that ties it
    to the launcher, then torch, ``modules`` and ``entry``'s own module (the forkserver skips a
    module that fails to import). None of them starts a thread on import (a fork copies only the
    calling thread; tests/cli/test_launch_start.py counts the forkserver's threads)."""
    names = [f"{__package__}._forkserver_guard", "torch", "torch.distributed", *modules]
    if entry.__module__ != "__main__":
        names.append(entry.__module__)
    return list(dict.fromkeys(names))


FORKSERVER_TEMP: list[str] = []  # multiprocessing's temporary directory, once a forkserver made it


def start_forkserver(preload: list[str]) -> None:
    """Start this process's forkserver with ``preload`` imported, from this (the main) thread: the
    guard's parent-death signal follows the thread that started it. A forkserver that already
    runs (started earlier in this process) is used as it is: its imports may differ.

    Its socket lives in multiprocessing's own temporary directory (``mkdtemp``: mode 0700), which
    :func:`make_forkserver_temp` makes in the system's temporary directory before the launch's
    private one is set: multiprocessing removes it when this process exits normally, and would
    fail on one already removed with the run directory; :func:`.launch.exit_now` removes it too.
    """
    multiprocessing.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()


def make_forkserver_temp() -> None:
    """Make multiprocessing's temporary directory now, in the system's temporary directory (call
    before :func:`shardkit._local_world.private_temp`): see :func:`start_forkserver`."""
    FORKSERVER_TEMP[:] = [multiprocessing.util.get_temp_dir()]
