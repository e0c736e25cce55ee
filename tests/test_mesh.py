"""ParallelDims: validation (pure) and the named DeviceMesh it builds."""

import pytest

from harness.helpers import rank
from shardkit import ParallelDims, ShardkitError, ShardkitTypeError


def test_defaults_and_product():
    dims = ParallelDims(dp=2, tp=2)
    assert dims.product == 4 and dims.active_axes() == ["dp", "tp"]
    assert dims.degrees == {"dp": 2, "pp": 1, "cp": 1, "ep": 1, "tp": 2}


@pytest.mark.parametrize("kwargs,err", [
    (dict(tp=0), ShardkitError), (dict(dp=-1), ShardkitError), (dict(tp=2.0), ShardkitTypeError),
    (dict(tp=True), ShardkitTypeError), (dict(dp=2, tp=2, world_size=6), ShardkitError),
])
def test_invalid(kwargs, err):
    with pytest.raises(err):
        ParallelDims(**kwargs)


@pytest.mark.world(4)
def test_build_mesh_2x2():
    mesh = ParallelDims(dp=2, tp=2).build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp", "pp", "cp", "ep", "tp")
    tp, dp = mesh["tp"], mesh["dp"]
    assert tp.size() == 2 and dp.size() == 2
    # tp is innermost: tp peers are adjacent ranks, dp peers are 2 apart.
    assert tp.mesh.flatten().tolist() == [rank() // 2 * 2, rank() // 2 * 2 + 1]
    assert dp.mesh.flatten().tolist() == [rank() % 2, rank() % 2 + 2]
