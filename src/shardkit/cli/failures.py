"""Why a local launch failed, in the order to read it: the root-cause rank first.

The ranks of a failed job all fail, most of them because of another: a peer that closed its
connection, a collective that timed out waiting. :func:`format_failures` puts first the rank the
watchdog stopped (with why), the rank whose heartbeat stopped, the rank the others waited for
(slow but alive, from the flight records' entry times: :func:`flight_waits`), or the rank with
its own error; every other rank gets one line.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..comm.flight_report import Wait

__all__ = ["format_failures", "flight_waits"]

# Exceptions that a rank raises because *another* rank died (its peer closed the connection or
# the store went away): secondary, never the root cause when another rank has its own error.
_SECONDARY = ("DistNetworkError", "DistBackendError", "Connection closed by peer", "Connection reset", "Broken pipe")


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


def format_failures(
    err,
    stalled: dict[int, float] | None = None,
    stopped: dict[int, str] | None = None,
    waited: list[Wait] | None = None,
) -> str:
    """The root-cause rank's traceback (for a :class:`~shardkit.ShardkitError`, its message and
    where it was raised), then one line per other failed rank.

    A rank that stopped answering (``stalled``: its heartbeats ended long before the others')
    comes first, named as the suspect: the others' timeout errors are what waiting for it
    looks like, not a cause.

    Args:
        err: a ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``.
        stalled: ``{rank: seconds its last heartbeat lags the newest}``
            (:func:`shardkit.train.watchdog.stalled_ranks`); None or empty: no rank went quiet.
        stopped: ``{rank: the watchdog's announcement}`` of the ranks it killed
            (:class:`shardkit.train.watchdog.Watchdog`): named first, with why; their ``-9`` is
            not a crash (nor an out-of-memory kill).
        waited: who waited for whom in the last collectives, from the flight records
            (:func:`shardkit.comm.flight_report.waited_for`). When no rank went quiet and the
            first failure is a timeout (or a peer's hang-up), the rank the others waited for is
            named first: slow but alive, it is the cause, and the timeouts are what waiting looks like.
    """
    stopped = stopped or {}
    stalled = {r: s for r, s in (stalled or {}).items() if r not in stopped}
    failures = sorted(err.failures.items(), key=lambda item: (item[0] not in stalled, *_order(item)))
    lines = [stopped[r] for r in sorted(stopped)]  # the root cause: why the watchdog stopped them
    failures = [(r, f) for r, f in failures if r not in stopped]
    for r in sorted(stalled):
        how = f"exit code {err.failures[r].exitcode}" if r in err.failures else "then stopped by the launcher"
        lines.append(
            f"rank {r} stopped answering first (suspect): its heartbeat stopped {stalled[r]:.1f} s before "
            f"the other ranks' last; they timed out waiting for it ({how})"
        )
    others = [(r, f) for r, f in failures if r not in stalled]
    if not stalled and not stopped and failures and waited and _is_waiting(_message(failures[0][1])):
        w = waited[0]
        lines.append(f"rank {w.late} was slow, not stuck (it kept beating); the others timed out: {w.describe()}")
    elif not stalled and not stopped and failures:
        (rank, first), others = failures[0], failures[1:]
        # One of shardkit's own errors says what is wrong in its message (agreed errors are the
        # same on every rank): a traceback would only bury it. Any other error keeps its traceback.
        concise = _shardkit_error(_message(first))
        lines += [
            f"rank {rank} failed first (exit code {first.exitcode}):",
            concise if concise is not None else _message(first).rstrip(),
        ]
    for r, f in others:
        last = _message(f).strip().splitlines()[-1:] or [""]
        lines.append(f"rank {r} also stopped (exit code {f.exitcode}): {last[0]}")
    return "\n".join(lines)


def _is_waiting(text: str) -> bool:
    """True when a rank's error is what waiting for a peer ends in: a collective's timeout (gloo's
    "Timed out waiting", NCCL's watchdog timeout) or a peer's hang-up."""
    return bool(_TIMED_OUT.search(text)) or any(s in text for s in _SECONDARY)


_TIMED_OUT = re.compile(r"timed out|timeout", re.I)
# The last line of a traceback of shardkit's own errors (``shardkit.errors.NonFiniteError: ...``),
# and the innermost frame of a traceback.
_OWN_ERROR = re.compile(r"^shardkit\.(?:errors|_optional)\.(\w+): ", re.S)
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (\S+)$')


def _shardkit_error(text: str) -> str | None:
    """A rank's traceback as ``Class: message`` and where it was raised, when the error is one of
    shardkit's own (a :class:`~shardkit.ShardkitError`: its message is written for the user);
    None for any other error, whose traceback is the diagnosis."""
    lines = text.rstrip().splitlines()
    start = next((i for i, line in enumerate(lines) if _OWN_ERROR.match(line)), None)
    if start is None:
        return None
    frames = [m for line in lines[:start] if (m := _FRAME.match(line))]
    where = f"\n  (raised at {frames[-1].group(1)}:{frames[-1].group(2)}, in {frames[-1].group(3)})" if frames else ""
    return "\n".join(lines[start:]).removeprefix("shardkit.errors.").removeprefix("shardkit._optional.") + where


def flight_waits(flight_dir: str, timeout_s: float) -> list[Wait] | None:
    """Who waited for whom, from the ranks' flight records in ``flight_dir`` (the heartbeats'
    directory); None without records. Ranks that waited about ``timeout_s`` timed out."""
    from ..comm.flight_report import load_dumps, waited_for  # imports torch (shardkit.comm): not at import time

    try:
        return waited_for(load_dumps(flight_dir), timeout_s / 2) if os.path.isdir(flight_dir) else None
    except (OSError, ValueError, KeyError, TypeError):  # a torn record: the flight report says more
        return None
