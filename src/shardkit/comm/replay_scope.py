"""Collectives a selective checkpoint must issue again instead of keeping: :func:`unreplayed`.

The selective checkpoint (:class:`shardkit.parallelize.checkpointing.CollectiveReplay`) keeps the
result of every collective of a block so that its recompute does not communicate. That is wrong
for a collective whose output is exactly what a layout chose not to keep: the sequence-parallel
all-gather under ``sp_activation="shard"`` (:mod:`shardkit.tensor_parallel.sp_saved`), whose
``T x H`` output is the memory the shard layout saves. Inside :func:`unreplayed` the replay
neither keeps nor serves a c10d op, so the recompute issues it (ledger phase ``"recompute"``).

The flag is per thread: it is set and cleared around one synchronous call, on the thread that
runs it (the forward, or the recompute on the autograd engine's thread).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["unreplayed", "replay_excluded"]

_state = threading.local()


@contextlib.contextmanager
def unreplayed() -> Iterator[None]:
    """Collectives issued inside are not kept by a selective checkpoint's replay (module docstring)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def replay_excluded() -> bool:
    """Whether this thread is inside :func:`unreplayed`."""
    return getattr(_state, "depth", 0) > 0
