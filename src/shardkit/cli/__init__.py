"""The ``shardkit`` command line (``python -m shardkit`` is the same): flags, launch, report.

The training application it runs lives in :mod:`shardkit.train`. Its modules lived here until
this release; ``shardkit.cli.<module>`` still imports them, with a ``DeprecationWarning`` naming
the new path (removed in the next release).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``shardkit.cli.<old>`` as the moved module itself (the same module object, so
    monkeypatching either name patches both), with a ``DeprecationWarning``."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = _MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(
            f"{spec.name} is deprecated: import {new} (removed in the next release)", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the moved module is already executed


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
