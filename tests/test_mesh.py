"""ParallelDims: validation (pure), the named DeviceMesh, its flattened views and the expert mesh."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank
from shardkit import ParallelDims, ParallelMesh, ShardkitError, ShardkitTypeError


def test_defaults_and_product():
    dims = ParallelDims(dp_replicate=2, tp=2)
    assert dims.product == 4 and dims.active_axes() == ["dp_replicate", "tp"]
    assert dims.degrees == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 1,
        "cp_ring": 1,
        "cp_ulysses": 1,
        "spatial_h": 1,
        "spatial": 1,
        "tp": 2,
    }
    assert (dims.dp, dims.cp, dims.cp_mode) == (2, 1, None)
    assert dims.describe() == "dp_replicate=2 x tp=2"
    assert ParallelDims().describe() == "single process"


def test_ep_borrows_ranks():
    # ep does not multiply the world: it borrows from dp_shard x cp x tp.
    dims = ParallelDims(dp_shard=2, tp=2, ep=4)
    assert dims.product == 4 and dims.ep_borrow == 4
    assert ParallelDims(cp_ring=2, cp_ulysses=2).cp_mode == "usp"
    assert ParallelDims(cp_ring=2).cp_mode == "ring" and ParallelDims(cp_ulysses=3).cp_mode == "ulysses"


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(tp=0), ShardkitError, "tp must be >= 1"),
        (dict(dp_replicate=-1), ShardkitError, "dp_replicate must be >= 1"),
        (dict(tp=2.0), ShardkitTypeError, "tp must be an int"),
        (dict(tp=True), ShardkitTypeError, "tp must be an int"),
        (dict(dp_replicate=2, tp=2, world_size=6), ShardkitError, "multiply to 4, but the world size is 6"),
        (dict(tp=2, ep=4), ShardkitError, "ep=4 must divide dp_shard x cp_ring x cp_ulysses x tp = 2"),
        (dict(dp_replicate=3, ep=2), ShardkitError, "ep=2 must divide .* = 1, or be a multiple of it that divides"),
        (dict(dp_replicate=2, tp=4, ep=6), ShardkitError, "ep=6 must divide .* = 4, or be a multiple"),
        (dict(dp_replicate=4, tp=2, ep=6), ShardkitError, "ep=6 must divide .* = 2, or be a multiple"),
        (dict(spatial=2, dp_shard=2, ep=2), ShardkitError, "spatial"),
    ],
)
def test_invalid(kwargs, err, match):
    with pytest.raises(err, match=match):
        ParallelDims(**kwargs)


def test_error_names_every_degree():
    with pytest.raises(ShardkitError) as e:
        ParallelDims(tp=2, cp_ring=3, world_size=4)
    for axis in ("dp_replicate", "dp_shard", "pp", "cp_ring", "cp_ulysses", "spatial", "tp", "ep"):
        assert f"{axis}=" in str(e.value)


def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


@pytest.mark.world(4)
def test_build_mesh_2x2():
    mesh = ParallelDims(dp_replicate=2, tp=2).build_mesh("cpu")
    assert mesh.root.mesh_dim_names == ("dp_replicate", "tp")  # size-1 axes get no group
    assert (mesh.size("pp"), mesh.local_rank("cp_ring"), mesh.size("cp")) == (1, 0, 1)
    tp, dp = mesh["tp"], mesh["dp"]
    assert tp.size() == 2 and dp.size() == 2
    # tp is innermost: tp peers are adjacent ranks, dp peers are 2 apart.
    assert _ranks(tp) == [rank() // 2 * 2, rank() // 2 * 2 + 1]
    assert _ranks(dp) == [rank() % 2, rank() % 2 + 2]
    assert _ranks(mesh["dp_cp"]) == _ranks(dp)


@pytest.mark.world(4)
def test_flattened_views_of_dp_and_cp():
    # pp outermost, then dp_shard, cp_ring: rank = 2 * dp_shard + cp_ring
    mesh = ParallelDims(dp_shard=2, cp_ring=2).build_mesh("cpu")
    me = rank()
    assert _ranks(mesh["cp"]) == [me // 2 * 2, me // 2 * 2 + 1]
    assert _ranks(mesh["dp"]) == [me % 2, me % 2 + 2]
    assert _ranks(mesh["dp_cp"]) == [0, 1, 2, 3] and _ranks(mesh["dp_shard_cp"]) == [0, 1, 2, 3]
    # the flattened group really communicates over its 4 ranks
    x = torch.tensor([float(me)])
    dist.all_reduce(x, group=mesh["dp_cp"].get_group())
    assert x.item() == 6.0


@pytest.mark.world(4)
def test_subgroups_inherit_the_world_timeout():
    mesh = ParallelDims(dp_replicate=2, tp=2).build_mesh("cpu")
    # the world's own (harness/world.py: PG_TIMEOUT, stretched by the load when the world started)
    want = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    assert want >= timedelta(seconds=1)
    for name in ("tp", "dp_replicate", "dp_cp"):
        group = mesh[name].get_group()
        assert group._get_backend(torch.device("cpu")).options._timeout == want, name


@pytest.mark.world(4)
def test_expert_mesh_borrows_dp_shard_and_tp():
    emesh = ParallelDims(dp_shard=2, tp=2, ep=2).build_mesh("cpu")
    me = rank()
    # ep groups: consecutive pairs (inside a tp group); experts replicated across the pairs.
    assert _ranks(emesh["ep"]) == [me // 2 * 2, me // 2 * 2 + 1]
    assert _ranks(emesh["edp"]) == [me % 2, me % 2 + 2]
    plain = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    assert (plain.size("ep"), plain.size("edp"), plain.local_rank("ep")) == (1, 1, 0)
    whole = ParallelDims(dp_shard=2, tp=2, ep=4).build_mesh("cpu")
    assert _ranks(whole["ep"]) == [0, 1, 2, 3] and whole.size("edp") == 1


@pytest.mark.world(4)
def test_expert_mesh_borrows_dp_replicas():
    # ep past one replica's dp_shard x cp x tp ranks takes whole blocks of consecutive replicas
    me = rank()
    across = ParallelDims(dp_replicate=2, tp=2, ep=4).build_mesh("cpu")
    assert _ranks(across["ep"]) == [0, 1, 2, 3] and across.size("edp") == 1
    replicas = ParallelDims(dp_replicate=4, ep=2).build_mesh("cpu")
    assert _ranks(replicas["ep"]) == [me // 2 * 2, me // 2 * 2 + 1]
    assert _ranks(replicas["edp"]) == [me % 2, me % 2 + 2]
    # the dense gradients still span every replica
    assert replicas.size("dp_cp") == 4


def test_unknown_mesh_name():
    with pytest.raises(ShardkitError, match="no mesh named 'dpp'"):
        ParallelMesh(ParallelDims(), None, {})["dpp"]


@pytest.mark.world(2)
def test_build_mesh_wrong_world():
    with pytest.raises(ShardkitError, match="world size is 2"):
        ParallelDims(tp=4).build_mesh("cpu")


@pytest.mark.world(4)
def test_ledger_records_name_their_mesh_axis():
    from shardkit import CommLedger, all_reduce_forward

    mesh = ParallelDims(dp_shard=2, cp_ring=2, ep=2).build_mesh("cpu")
    x = torch.ones(3)
    with CommLedger() as ledger:
        for name in ("cp_ring", "dp_shard", "dp_cp", "ep", "edp"):
            all_reduce_forward(x, mesh[name])
        all_reduce_forward(x, dist.group.WORLD)
    # dp_cp spans the world's ranks but is its own group: named apart from "world"
    assert [mesh.axis_of(r.group_name) for r in ledger.records] == [
        "cp_ring",
        "dp_shard",
        "dp_cp",
        "ep",
        "edp",
        "world",
    ]
    assert mesh.axis_of(None) == "other"
    single = ParallelDims(dp_replicate=4).build_mesh("cpu")
    # with one axis the flattened views are that axis's group: the axis name wins
    assert single.axis_of(single["dp_cp"].get_group().group_name) == "dp_replicate"


@pytest.mark.world(4)
def test_tiles_mesh_has_h_and_w_dims():
    mesh = ParallelDims(spatial_h=2, spatial=2).build_mesh("cpu")
    assert mesh.root.mesh_dim_names == ("spatial_h", "spatial")
    assert _ranks(mesh["spatial"]) == [rank() // 2 * 2, rank() // 2 * 2 + 1]
    assert _ranks(mesh["spatial_h"]) == [rank() % 2, rank() % 2 + 2]
