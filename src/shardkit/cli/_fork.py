"""The forked start of a local launch (``launch_local(preload=...)``): the forkserver's imports,
its start, and what a forked rank must take from the launcher that a spawned one inherits.

Why: on a loaded 2-core machine, four spawned ranks each importing torch, transformers' modeling
code and shardkit were most of the time to the first step (issue 32: 19 s of a 21 s set-up at
load 14); a forkserver imports them once and forks the ranks from there.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence

from ..errors import ShardkitError
from ..train.model_names import model_facts
from ..train.watchdog import parent_pid

__all__ = [
    "take_launcher_env",
    "parent_of",
    "forkserver_preload",
    "modeling_modules",
    "Forkserver",
    "remove_stale_temps",
    "check_socket_dir",
]

# The longest path a Unix socket's address holds (sun_path: 108 bytes on Linux, 104 on macOS and
# the BSDs, each with its terminating NUL).
SUN_PATH_MAX = 107 if os.uname().sysname == "Linux" else 103
# What multiprocessing's forkserver adds to the system's temporary directory for its socket:
# "/pymp-" and 8 characters (util.get_temp_dir's mkdtemp), "/listener-" and 8 (arbitrary_address).
_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")

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


def forkserver_preload(modules: Sequence[str], entry: Callable | str) -> list[str]:
    """The modules the forkserver imports before it forks any rank: first the guard that ties it
    to the launcher, then torch, ``modules`` and ``entry``'s own module (``entry``: the rank's
    function, or its module's name; the forkserver skips a module that fails to import). None
    of them starts a thread on import (a fork copies only the calling thread;
    tests/cli/test_launch_start.py counts the forkserver's threads)."""
    names = [f"{__package__}._forkserver_guard", "torch", "torch.distributed", *modules]
    module = entry if isinstance(entry, str) else entry.__module__
    if module != "__main__":
        names.append(module)
    return list(dict.fromkeys(names))


def modeling_modules(model: str, model_path: str | None = None) -> list[str]:
    """The transformers modeling module of ``--model model`` (``transformers.models.T.modeling_T``
    of its ``model_type`` T; a ``--model-path`` checkpoint's from its ``config.json``), for the
    launch's forkserver to import once instead of every rank (issue 32: 19 s of a 21 s set-up at
    load 14 was 4 ranks importing it). [] for a model without one (conv-ae) or an unreadable
    config; a name transformers lacks is skipped by the forkserver. No torch: ``shardkit train``
    calls it on its torch-free checks' options, before the checks that import torch.

    Raises:
        ShardkitError: ``model`` is not a registered name.
    """
    model_type = model_facts(model).model_type
    if model_path is not None:
        try:
            with open(os.path.join(model_path, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):  # a GGUF file, a folder checked later
            model_type = None
    return [f"transformers.models.{model_type}.modeling_{model_type}"] if isinstance(model_type, str) else []


class Forkserver:
    """This launch's forkserver, started once with its imports (:meth:`start`), and the
    temporary directory multiprocessing made for its socket, which the launch owns.

    Attributes:
        preload: the modules it imports before forking any rank (:func:`forkserver_preload`).
        temp: multiprocessing's temporary directory (``mkdtemp``: mode 0700) in the system's
            temporary directory: multiprocessing removes it when the launcher exits normally (and
            would fail on one already removed with the run directory); :meth:`remove_temp` when
            the launcher ends with ``os._exit`` (:func:`.launch.exit_now`); a SIGKILLed
            launcher's is removed by the next launch (:func:`remove_stale_temps`).
    """

    def __init__(self, preload: list[str], temp: str) -> None:
        self.preload, self.temp = preload, temp

    @classmethod
    def start(cls, modules: Sequence[str], entry: Callable | str) -> Forkserver:
        """Start this process's forkserver with :func:`forkserver_preload` ``(modules, entry)``,
        from this (the main) thread: the guard's parent-death signal follows the thread that
        started it. Returns at once: the forkserver imports while the caller goes on (``shardkit
        train`` starts it right after its torch-free checks, so that its imports overlap the
        launcher's own; issue 32). Call before :func:`shardkit._local_world.private_temp`: its
        socket's directory must outlive the launch's private one.

        A forkserver that already runs (started earlier in this process) is used as it is: its
        imports may differ. It has the caller's environment of now; each rank takes the
        launcher's as it is at launch (:func:`take_launcher_env`).
        """
        check_socket_dir(tempfile.gettempdir())
        remove_stale_temps()
        temp = multiprocessing.util.get_temp_dir()  # made now, in the system's temporary directory
        _mark_owner(temp)
        preload = forkserver_preload(modules, entry)
        multiprocessing.set_forkserver_preload(preload)
        multiprocessing.forkserver.ensure_running()
        return cls(preload, temp)

    def remove_temp(self) -> None:
        """Remove :attr:`temp` (an ``os._exit`` skips multiprocessing's exit handler that would)."""
        shutil.rmtree(self.temp, ignore_errors=True)


def check_socket_dir(folder: str) -> None:
    """Refuse a system temporary directory ``folder`` too long to hold the forkserver's Unix
    socket (``folder/pymp-XXXXXXXX/listener-XXXXXXXX``: at most :data:`SUN_PATH_MAX` bytes).

    Raises:
        ShardkitError: the socket's path would be too long (multiprocessing's own error is
            ``OSError: AF_UNIX path too long`` from deep inside the forkserver's start).
    """
    length = len(os.fsencode(folder)) + _SOCKET_SUFFIX
    if length > SUN_PATH_MAX:
        raise ShardkitError(
            f"the temporary directory {folder!r} is too long for the local launch's Unix socket "
            f"({length} bytes with the socket's name; the limit is {SUN_PATH_MAX}): set TMPDIR to "
            f"a directory of at most {SUN_PATH_MAX - _SOCKET_SUFFIX} characters"
        )


_OWNER = "shardkit-launcher"  # in a forkserver's temporary directory: "PID START_TIME" of its launcher


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, Linux ``/proc``), None where it cannot be read
    (no such process, or no ``/proc``): with the pid, it names one process, not a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22; the name may hold spaces
    except (OSError, IndexError):
        return None


def _mark_owner(temp: str) -> None:
    """Write this launcher's pid and start time into its forkserver's directory ``temp``."""
    started = _start_time(os.getpid())
    if started is not None:  # Linux: elsewhere nothing marks it, and nothing sweeps it
        with open(os.path.join(temp, _OWNER), "w") as f:
            f.write(f"{os.getpid()} {started}")


def remove_stale_temps(folder: str | None = None) -> list[str]:
    """Remove the forkserver directories (``pymp-*`` in ``folder``, default the system's
    temporary directory) that a launcher marked (:class:`Forkserver`) and that outlived it: a
    SIGKILLed launcher runs no exit handler, and its forkserver dies with it
    (:mod:`._forkserver_guard`), so nothing else would. Only this user's, marked ones whose
    launcher (pid and start time) is gone; another program's ``pymp-*`` is never touched.
    Returns the removed paths."""
    folder = tempfile.gettempdir() if folder is None else folder
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith("pymp-")]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER)) as f:
                pid, started = f.read().split()
        except (OSError, ValueError):  # not ours, not readable, or being made
            continue
        if _start_time(int(pid)) != started:  # that launcher is gone (or its pid is another's now)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
