"""The sharding floor and checkpoint IO moved (issue 20): every old module path and name still
works for one release, as the moved object itself, with a DeprecationWarning naming the new path;
the public names of ``shardkit`` work without one."""

import importlib
import sys
import warnings

import pytest

import shardkit
from shardkit._moved import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_the_moved_module_with_a_warning(old):
    new = MOVED_MODULES[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: import {new} \(removed"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # one module: a patch of either name patches both
    assert module.__spec__.name == new  # the alias did not take over the moved module's spec


@pytest.mark.parametrize(
    ("old", "names"),
    [
        ("shardkit.layouts", ["Replicate", "Shard", "Partial", "check_layout"]),
        ("shardkit.mesh", ["ParallelDims", "ParallelMesh", "AXES", "FLAT_VIEWS"]),
        ("shardkit.tensor_parallel.spec", ["ShardSpec", "shard_spec", "cut", "gather_full", "shard_parameter"]),
        ("shardkit.tensor_parallel.dcp", ["save_sharded_checkpoint", "load_sharded_checkpoint", "owned_ranges"]),
        ("shardkit.tensor_parallel.checkpoint", ["SafetensorsCheckpoint", "load_sharded", "materialize_meta", "Piece"]),
    ],
)
def test_every_public_name_of_an_old_module_is_still_there(old, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(old)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{old} lost {missing}"


@pytest.mark.parametrize(
    ("module", "name", "new"),
    [
        ("shardkit.tensor_parallel", "load_sharded", "shardkit.checkpoint"),
        ("shardkit.tensor_parallel", "SafetensorsCheckpoint", "shardkit.checkpoint"),
        ("shardkit.tensor_parallel", "materialize_meta", "shardkit.checkpoint"),
        ("shardkit.tensor_parallel", "save_sharded_checkpoint", "shardkit.checkpoint"),
        ("shardkit.tensor_parallel", "load_sharded_checkpoint", "shardkit.checkpoint"),
        ("shardkit.pipeline_parallel.vtp", "StageGroups", "shardkit.sharding"),
        ("shardkit.pipeline_parallel.vtp", "new_stage_groups", "shardkit.sharding"),
    ],
)
def test_an_old_name_is_the_moved_object_with_a_warning(module, name, new):
    old = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} is deprecated: import it from {new} \(removed"):
        obj = getattr(old, name)
    assert obj is getattr(importlib.import_module(new), name)


def test_unknown_names_still_raise_attribute_error():
    import shardkit.tensor_parallel as tp

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tp.no_such_name  # noqa: B018


def test_the_public_names_and_new_homes_import_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from shardkit import ParallelDims, Replicate, Shard, load_sharded, save_sharded_checkpoint
        from shardkit.checkpoint import SafetensorsCheckpoint, load_sharded_checkpoint
        from shardkit.pipeline_parallel import StageGroups, new_stage_groups
        from shardkit.sharding import ParallelMesh, ShardSpec, gather_full
        from shardkit.tensor_parallel import Replicate as TpReplicate
        from shardkit.tensor_parallel import ShardSpec as TpShardSpec
    assert Replicate is TpReplicate and ShardSpec is TpShardSpec
    assert shardkit.ParallelDims is ParallelDims and shardkit.Shard is Shard
    assert shardkit.load_sharded is load_sharded and shardkit.save_sharded_checkpoint is save_sharded_checkpoint
    assert all(x is not None for x in (SafetensorsCheckpoint, load_sharded_checkpoint, StageGroups))
    assert all(x is not None for x in (new_stage_groups, ParallelMesh, gather_full))
