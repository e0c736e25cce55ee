"""The schedule call's agreement, once per stage and table in the default mode (issue 29).

:func:`~shardkit.comm.agree.agree` costs one all-reduce and one device-to-host read. The
pipeline runners agree per call on the schedule table (or boundary shapes), every rank's data
and whether the shape caches may be kept. In the default mode (checks off) a stage that already
agreed on the same table and whose previous call completed skips it: the table is a pure
function of arguments every rank derives alike, as torchtitan's schedules assume. With
:func:`~shardkit.comm.checks` on, every call agrees (the cross-rank verdict on every step).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from ..comm.checks import checks_enabled
from ..errors import ShardkitError

__all__ = ["REJECTED", "agree_once"]

# agree()'s headline for the pipeline's argument checks (the stage classes and run_schedule)
REJECTED = "{n} of {size} pipeline ranks rejected their arguments"

_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stage -> the key it agreed on


def agree_once(stage: object, key: str, clean: bool, error: str | None, op: str, run: Callable[[], bool]) -> bool:
    """``run()`` (the agreement: whether every rank may keep its caches) unless ``stage`` already
    agreed on ``key`` and is ``clean`` (its previous call completed) with checks off: then True,
    or this rank's ``error`` raised here (the other ranks fail in the schedule's first transfer).
    """
    if clean and not checks_enabled() and _AGREED.get(stage) == key:
        if error is not None:
            raise ShardkitError(f"{op}: {error}")
        return True
    keep = run()
    _AGREED[stage] = key
    return keep
