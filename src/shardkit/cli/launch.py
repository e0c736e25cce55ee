"""Start the workers of a CLI job: a local elastic launch, or the world torchrun already made.

The local launch is ``torchrun --standalone`` done in-process: torch.distributed's elastic
agent with a c10d rendezvous on a free localhost port, no restarts, and a 0.1 s monitor
interval, so that when any rank fails the agent stops all others within a fraction of a second
(instead of leaving them to time out in a collective). The failing rank's traceback (recorded by
``@record`` on the entry point) is then printed first.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from .._quiet import quiet_third_party

__all__ = ["under_torchrun", "launch_local", "LaunchFailed", "format_failures"]

# Exceptions that a rank raises because *another* rank died (its peer closed the connection or
# the store went away): secondary, never the root cause when another rank has its own error.
_SECONDARY = ("DistNetworkError", "DistBackendError", "Connection closed by peer", "Connection reset", "Broken pipe")


class LaunchFailed(Exception):
    """A worker failed; the message is the formatted root cause."""


def under_torchrun() -> bool:
    """True inside a process started by torchrun / torch elastic (its env vars are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _message(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        return msg.get("extraInfo", {}).get("py_callstack") or msg.get("message", "<no message>")
    return str(msg) or f"exit code {failure.exitcode} (no error file)"


def _order(item) -> tuple:
    """Root cause first: ranks with their own error file, non-secondary errors, earliest."""
    rank, failure = item
    text = _message(failure)
    has_file = isinstance(failure.message, dict)
    secondary = any(s in text for s in _SECONDARY)
    # A secondary error (a peer closed the connection) is never the root cause, even when the
    # rank that really failed has not written its error file yet (a race under load).
    return (secondary, not has_file, failure.timestamp, rank)


def format_failures(err) -> str:
    """The root-cause rank's traceback, then one line per other failed rank.

    Args:
        err: a ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``.
    """
    failures = sorted(err.failures.items(), key=_order)
    (rank, first), others = failures[0], failures[1:]
    lines = [f"rank {rank} failed first (exit code {first.exitcode}):", _message(first).rstrip()]
    for r, f in others:
        last = _message(f).strip().splitlines()[-1:] or [""]
        lines.append(f"rank {r} also stopped (exit code {f.exitcode}): {last[0]}")
    return "\n".join(lines)


def _quiet_then(entry: Callable, *args: Any) -> Any:
    """One local rank: third-party progress bars and warnings on rank 0 only, then ``entry``."""
    quiet_third_party(int(os.environ.get("RANK", "0")))
    return entry(*args)


def launch_local(nproc: int, entry: Callable, *args) -> dict:
    """Run ``entry(*args)`` on ``nproc`` local processes; return ``{local_rank: return value}``.

    Args:
        nproc: number of worker processes.
        entry: a picklable top-level function (decorated with ``@record``).

    Raises:
        LaunchFailed: a worker failed; the message holds its traceback.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardkit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # standalone: the agent hosts the store on a free port
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # The agent and torch.multiprocessing log each worker they stop before raising; silenced, so
    # that the root cause (format_failures) is the first thing printed.
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        return elastic_launch(config, _quiet_then)(entry, *args)
    except ChildFailedError as err:
        raise LaunchFailed(format_failures(err)) from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def print_failure(err: LaunchFailed) -> None:
    """Print a launch failure to stderr, unwrapped (tracebacks keep their lines)."""
    print(f"shardkit: a worker failed; the job was stopped.\n{err}", file=sys.stderr, flush=True)
