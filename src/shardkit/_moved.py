"""Deprecated aliases of moved modules and names, kept for one release.

* :func:`install_moved_modules`: ``import old.module`` gives the moved module itself (the same
  module object, so monkeypatching either name patches both), with a ``DeprecationWarning``
  naming the new path.
* :func:`moved_names`: a module-level ``__getattr__`` that resolves the old names of a module
  (``shardkit.tensor_parallel.load_sharded``) from their new module, with the same warning.

Both resolve the new module when the old name is used, by name (``importlib``), so an alias
draws no import edge from the old package to the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "install_moved_modules", "moved_names"]

MOVED_MODULES: Mapping[str, str] = MappingProxyType(
    {
        "shardkit.layouts": "shardkit.sharding.layouts",
        "shardkit.mesh": "shardkit.sharding",
        "shardkit.tensor_parallel.spec": "shardkit.sharding.spec",
        "shardkit.tensor_parallel.dcp": "shardkit.checkpoint.dcp",
        "shardkit.tensor_parallel.checkpoint": "shardkit.checkpoint.safetensors",
        "shardkit.pipeline_parallel.hf_decoder": "shardkit.parallelize.decoder_stages",
    }
)
"""Library modules moved in issues 20 and 30 (old name -> new name), importable under the old name until
the next release (``shardkit/__init__.py`` installs them)."""


class _AliasLoader(importlib.abc.Loader):
    """Loads one old module name as the module it moved to."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: Any = None

    def create_module(self, spec) -> ModuleType:
        warnings.warn(
            f"{spec.name} is deprecated: import {self.new} (removed in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The moved module already ran; the import system gave it the alias's spec: put its own back.
        module.__spec__ = self.spec


class _MovedModules(importlib.abc.MetaPathFinder):
    """Finds the old module names of ``moved`` (old dotted name -> new dotted name)."""

    def __init__(self, moved: Mapping[str, str]) -> None:
        self.moved = dict(moved)

    def find_spec(self, fullname, path=None, target=None):
        new = self.moved.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install_moved_modules(moved: Mapping[str, str]) -> None:
    """Make every old module name of ``moved`` importable as its new module (idempotent).

    Args:
        moved: old dotted module name -> new dotted module name. The old file must be gone (the
            finder is consulted after the ordinary ones).
    """
    if not any(isinstance(f, _MovedModules) and f.moved == dict(moved) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules(moved))


def moved_names(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving the names that moved out of ``module``.

    Args:
        module: the old module's name (its ``__name__``), for the messages.
        names: old attribute name -> the dotted name of the module that now defines it.

    Returns:
        ``__getattr__(name)``: the moved object, with a ``DeprecationWarning`` naming its new
        module; ``AttributeError`` for any other name.
    """
    table = dict(names)

    def __getattr__(name: str) -> Any:
        new = table.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is deprecated: import it from {new} (removed in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__
