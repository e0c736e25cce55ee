"""The ``shardkit`` command line (``python -m shardkit`` is the same): flags, launch, report.

The training application it runs lives in :mod:`shardkit.train`. Its modules lived here until
this release; ``shardkit.cli.<module>`` still imports them, with a ``DeprecationWarning`` naming
the new path (removed in the next release).
"""

from __future__ import annotations

from .._moved import install_moved_modules
from .main import main

__all__ = ["main"]

# old module of shardkit.cli -> its home in shardkit.train (deprecated aliases, one release)
_MOVED = {
    name: f"shardkit.train.{name}"
    for name in (
        "config",
        "limits",
        "checkpoint_dir",
        "corpus",
        "data",
        "tokens",
        "pretrained",
        "model",
        "conv_ae",
        "lm_task",
        "trainer",
        "verify",
        "schedule",
        "metrics",
        "progress",
        "liveness",
    )
}
_MOVED["worker"] = "shardkit.train.run"


install_moved_modules({f"{__name__}.{old}": new for old, new in _MOVED.items()})
