"""Start the workers of a CLI job: a local elastic launch, or the world torchrun already made.

The local launch is ``torchrun --standalone`` done in-process: torch.distributed's elastic
agent, no restarts, and a 0.1 s monitor interval, so that when any rank fails the agent stops all
others within a fraction of a second (instead of leaving them to time out in a collective). The
failing rank's traceback (recorded by ``@record`` on the entry point) is then printed first.

Signals: SIGINT / SIGTERM to the launcher reach torch elastic's own handler, which stops every
worker with the same signal; :func:`launch_local` then raises :class:`LaunchInterrupted`
(``shardkit train`` prints one line and exits ``128 + signal``). Each worker takes the default
(terminating) action on SIGINT instead of Python's ``KeyboardInterrupt``, which only runs between
bytecodes and so waits out a blocked gloo collective; and each worker dies with its launcher
(:func:`_die_with_parent`), so a SIGKILLed launcher leaves no orphans.

Start-up: with ``preload`` the ranks are forked from a forkserver that imported torch, shardkit
and the model's modeling code once (:mod:`._fork`), instead of each spawned rank
importing them again: on a loaded 2-core machine those imports were most of the time to the
first step (issue 32). ``shardkit train`` starts it right after its torch-free checks, so that
its imports run beside the launcher's other checks. The forkserver dies with the launcher and,
like each forked rank, runs in a session of its own, as torchrun's ranks do
(:mod:`._forkserver_guard` says why); each rank gets the launcher's environment as it is at
launch (:func:`._fork.take_launcher_env`), as a spawned rank would.

Private: nothing of a local launch listens beyond loopback, and nothing it keeps can be read or
written by another user (:mod:`shardkit._local_world`: the caller's ``private_run_dir`` holds a
file rendezvous, the workers' store and the launch's temporary files).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, NoReturn

from .._local_world import no_shared_tcp_store, private_temp
from .._quiet import quiet_third_party
from ..train.liveness import read_heartbeats
from ..train.watchdog import Watchdog, stalled_ranks
from ._fork import Forkserver, parent_of, take_launcher_env
from .failures import flight_waits, format_failures

__all__ = [
    "under_torchrun",
    "launch_local",
    "LaunchFailed",
    "LaunchInterrupted",
    "format_failures",
    "print_failure",
    "exit_now",
]


class LaunchFailed(Exception):
    """A worker failed; the message is the formatted root cause."""


class LaunchInterrupted(Exception):
    """The launcher got SIGINT or SIGTERM and stopped every worker.

    Attributes:
        signum: the signal received.
        nproc: the workers stopped.
    """

    def __init__(self, signum: int, nproc: int) -> None:
        self.signum, self.nproc = int(signum), nproc
        super().__init__(f"interrupted ({signal.Signals(signum).name}), stopped {nproc} ranks")

    @property
    def exit_code(self) -> int:
        """The shell convention for a process ended by a signal: 128 + its number (130, 143)."""
        return 128 + self.signum


def under_torchrun() -> bool:
    """True inside a process started by torchrun / torch elastic (its env vars are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Make this worker exit at once when its launcher (pid ``parent``) dies, even by SIGKILL.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, delivered by the kernel the moment the parent
    exits (torch's spawn wrapper sets SIGINT there, which a rank blocked inside a gloo collective
    does not act on for seconds). Elsewhere (macOS has no prctl): a daemon thread polls
    ``os.getppid()`` every 0.1 s, since a re-parented process sees another parent id. Either way
    the launcher dying before this call is caught by the ``getppid`` check right after it.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.1)
            os._exit(128 + signal.SIGKILL)

        threading.Thread(target=watch, name="shardkit-parent-watchdog", daemon=True).start()
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def _own_session() -> None:
    """Start a session of this process's own (``setsid``), as torchrun does for each rank: Linux
    shares the processors between sessions first (:mod:`._forkserver_guard` says why it matters).
    Skipped where there is no ``setsid`` or this process already leads a group."""
    if hasattr(os, "setsid"):
        try:
            os.setsid()
        except OSError:  # a process-group leader cannot: it keeps the session it has
            pass


def _die_with_launcher(launcher: int) -> None:
    """Exit when the launcher (pid ``launcher``) dies: spawned, the launcher is this rank's parent
    (:func:`_die_with_parent`); forked, the parent is the launcher's forkserver, which is killed
    when the launcher dies (:mod:`._forkserver_guard`), so dying with it is enough, once its own
    parent is checked to be the launcher (Linux; a forkserver already orphaned has another)."""
    parent = os.getppid()
    _die_with_parent(parent)
    if parent != launcher and parent_of(parent) not in (launcher, None):
        os._exit(128 + signal.SIGKILL)


def _quiet_then(launcher: int, env: dict[str, str] | None, entry: Callable, *args: Any) -> Any:
    """One local rank: the launcher's environment and a session of its own (forked ranks: ``env``),
    exit with the launcher, SIGINT terminates, third-party progress bars and warnings on rank 0 only, then ``entry``."""
    if env is not None:  # forked: a session of its own, as a torchrun rank (_own_session)
        take_launcher_env(env)
        _own_session()
    _die_with_launcher(launcher)
    # Ctrl-C reaches every process of the terminal's group, and the launcher forwards its own
    # SIGINT: the default action ends the rank at once (no KeyboardInterrupt traceback per rank,
    # no wait for a blocked collective); the launcher prints the one line.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    quiet_third_party(int(os.environ.get("RANK", "0")))
    return entry(*args)


def launch_local(
    nproc: int,
    entry: Callable,
    *args,
    run_dir: str,
    heartbeats: str | None = None,
    timeout_s: float = 300.0,
    preload: Sequence[str] | Forkserver | None = None,
) -> dict:
    """Run ``entry(*args)`` on ``nproc`` local processes; return ``{local_rank: return value}``.

    Args:
        nproc: number of worker processes.
        entry: a picklable top-level function (decorated with ``@record``); it joins the world
            with :func:`init_local_world` (``run_dir`` is passed to it in ``args``).
        run_dir: a :func:`shardkit._local_world.private_run_dir`: the rendezvous store lives in it.
        heartbeats: the directory the ranks beat into (:class:`shardkit.train.liveness.Heartbeat`), if they do:
            a :class:`shardkit.train.watchdog.Watchdog` kills a rank that went silent while the job runs, and
            after a failure the ranks that stopped answering are named first as the suspects.
        timeout_s: the ranks' process-group timeout (seconds), which the silences are measured against.
        preload: None: each rank is a spawned interpreter that imports what it needs. Else the
            ranks are forked from a forkserver that imported torch, these modules and
            ``entry``'s module once (:meth:`._fork.Forkserver.start`, here), or from the
            :class:`._fork.Forkserver` given, started earlier (``shardkit train`` starts it
            before its own torch-dependent checks, with the model's modeling code). Not for a
            process that runs its own forkserver with other imports or output (pytest's
            harness): there is one per process.

    Raises:
        LaunchFailed: a worker failed; the message holds its traceback.
        LaunchInterrupted: the launcher got SIGINT / SIGTERM (from the terminal or ``kill``);
            every worker was stopped with the same signal.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from ..comm._compat import launch_config  # torch, like the imports above: not at import time

    config = launch_config(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardkit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        # a FileStore in the private directory: no rendezvous port at all
        rdzv_endpoint=os.path.join(run_dir, "rendezvous"),
        rdzv_configs={"store_type": "file"},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn" if preload is None else "forkserver",
        # A worker that ignores the forwarded signal is SIGKILLed after this many seconds
        # (torch's default 30 s would outlive the launcher's promise to stop within seconds;
        # a torch without the option, 2.11, keeps its 30 s: comm/_compat.launch_config).
        shutdown_timeout=2,
        # the agent's per-launch log directory (error files), else a new torchelastic_* in /tmp
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(run_dir, "logs")),
    )
    # The agent and torch.multiprocessing log each worker they stop before raising; silenced, so
    # that the root cause (format_failures) is the first thing printed.
    # (torch sets some child loggers' levels itself, so each existing one is silenced, not only the parents.)
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)]
    loggers = [logging.getLogger(name) for name in {*prefixes, *names}]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        watchdog = Watchdog(heartbeats, timeout_s, nproc) if heartbeats else None
        if preload is not None and not isinstance(preload, Forkserver):
            Forkserver.start(preload, entry)  # before private_temp: its socket outlives the run directory
        with no_shared_tcp_store(), private_temp(run_dir), watchdog or nullcontext():
            # a forked rank starts with its forkserver's environment: it takes the launch's
            env = None if preload is None else dict(os.environ)
            return elastic_launch(config, _quiet_then)(os.getpid(), env, entry, *args)
    except ChildFailedError as err:
        stalled = stalled_ranks(read_heartbeats(heartbeats), timeout_s) if heartbeats else None
        stopped = {r: v.describe(r) for r, v in watchdog.stopped.items()} if watchdog is not None else None
        waited = flight_waits(heartbeats, timeout_s) if heartbeats else None
        raise LaunchFailed(format_failures(err, stalled, stopped, waited)) from None
    except SignalException as err:  # the agent has stopped the workers with the same signal
        raise LaunchInterrupted(err.sigval, nproc) from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def print_failure(err: LaunchFailed | LaunchInterrupted) -> int:
    """Print why a launch ended to stderr (a failure's tracebacks keep their lines; an interrupt
    is one line); return the process exit code: 1, or 128 + the signal (130 SIGINT, 143 SIGTERM)."""
    if isinstance(err, LaunchInterrupted):
        print(f"shardkit: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    print(f"shardkit: a worker failed; the job was stopped.\n{err}", file=sys.stderr, flush=True)
    return 1


def exit_now(code: int, forkserver: Forkserver | None = None) -> NoReturn:
    """End the launcher at once with ``code``, after a failed or interrupted launch; remove
    ``forkserver``'s temporary directory (multiprocessing's exit handler would have).

    Every rank is already gone and the message printed; what is left is the interpreter's
    teardown of torch (module and object finalization), measured at 3-7 s on a loaded 2-core
    machine, during which the job would still have a live process past the promised 5 s.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if forkserver is not None:
        forkserver.remove_temp()
    os._exit(code)
