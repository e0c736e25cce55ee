"""The training application moved from ``shardkit.cli`` to ``shardkit.train`` (issue 20): every old
module path still imports, for one release, as the moved module itself, with a DeprecationWarning."""

import importlib
import sys
import warnings

import pytest

from shardkit.cli import _MOVED


@pytest.mark.parametrize("old", sorted(_MOVED))
def test_an_old_module_path_is_the_moved_module_with_a_warning(old):
    name = f"shardkit.cli.{old}"
    sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match=rf"{name} is deprecated: import {_MOVED[old]}"):
        module = importlib.import_module(name)
    assert module is importlib.import_module(_MOVED[old])  # one module: a patch of either name patches both


def test_the_front_door_and_unknown_names_are_not_aliased():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the command's own modules import without a warning
        importlib.import_module("shardkit.cli.launch")
        importlib.import_module("shardkit.cli.main")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("shardkit.cli.no_such_module")
