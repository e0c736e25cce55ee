"""Stage-boundary reshards between tp groups of different sizes (VTP): the piece plan (pure),
coordinate-encoded transfers compared bitwise in both directions for every layout pair, and
bad layouts raising on every rank."""

import itertools

import pytest
import torch

from harness.helpers import all_true, rank, subgroup, world_group
from shardkit.comm import CommLedger, checks
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel._reshard import Side, recv_side
from shardkit.pipeline_parallel._reshard import send_side as _post_send
from shardkit.pipeline_parallel.vtp import Replicate, Shard, leader_mode, local_box, piece_plan
from shardkit.sharding import StageGroups


def send_side(*args):
    """The sending side, waited for (the runner waits for its sends at the end of a call)."""
    shape, works = _post_send(*args)
    for w in works:
        w.wait()
    return shape


LAYOUTS = [Replicate(), Shard(1), Shard(2)]


def _region(box):
    return tuple(slice(lo, hi) for lo, hi in box)


@pytest.mark.parametrize("t_src,t_dst", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2), (2, 3), (4, 1)])
@pytest.mark.parametrize("shape", [(2, 5, 3), (1, 1, 4), (2, 0, 3)])
def test_piece_plan_covers_every_receiver_box_once(t_src, t_dst, shape):
    """Each receiving rank's box is tiled exactly once by pieces that lie inside their sender's box."""
    for src, dst in itertools.product(LAYOUTS, LAYOUTS):
        pieces = piece_plan(src, t_src, dst, t_dst, shape)
        assert pieces == sorted(pieces)
        lead = leader_mode(src, t_src, dst, t_dst)
        for j in range(t_dst):
            box = local_box(Replicate() if lead else dst, shape, t_dst, j)
            count = torch.zeros(shape, dtype=torch.int64)
            for p in pieces:
                if p.dst == j:
                    count[_region(p.box)] += 1
                    inside = local_box(src, shape, t_src, p.src)
                    assert all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(inside, p.box))
            want = torch.zeros(shape, dtype=torch.int64)
            if not lead or j == 0:
                want[_region(box)] = 1
            assert torch.equal(count, want), (src, dst, j)
        if isinstance(src, Shard) and isinstance(dst, Shard) and src == dst and t_src == t_dst:
            assert all(p.src == p.dst for p in pieces)  # Megatron SP pp x tp: rank i -> rank i


def _groups(stage_ranks):
    tps = [subgroup(tuple(r)) for r in stage_ranks]  # collective: every rank creates every group
    s = next(s for s, r in enumerate(stage_ranks) if rank() in r)
    return StageGroups(world_group(), stage_ranks, tps[s])


def _value(shape, tag):
    n = 1
    for d in shape:
        n *= d
    return torch.arange(n, dtype=torch.float64).reshape(shape) + 1000.0 * tag


def _transfer(groups, a, b, la, lb, shape, tag, static):
    """Stage ``a`` (layout ``la``) sends a coordinate-encoded tensor to stage ``b`` (``lb``);
    returns whether this rank's received block (if any) is bitwise right."""
    s, i = groups.stage_index, groups.tp_rank
    src, dst = Side(groups.stage_ranks[a], la), Side(groups.stage_ranks[b], lb)
    full = _value(shape, tag)
    decl = (shape, torch.float64) if static else None
    if s == a:
        local = full[_region(local_box(la, shape, src.size, i))]
        assert send_side(local, src, dst, groups.info, groups.tp, decl, "t", "forward") == tuple(shape)
    elif s == b:
        got, full_shape = recv_side(src, dst, groups.info, groups.tp, decl, torch.device("cpu"), "t", "forward")
        want = full[_region(local_box(lb, shape, dst.size, i))]
        return full_shape == tuple(shape) and got.dtype == want.dtype and torch.equal(got, want)
    return True


@pytest.mark.world(4, timeout=30)
@pytest.mark.parametrize(
    "stage_ranks", [[[0, 1], [2], [3]], [[0, 1], [2, 3]], [[0], [1, 2, 3]]], ids=["2-1-1", "2-2", "1-3"]
)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_boundary_reshard_bitwise_both_directions(stage_ranks, static):
    groups = _groups(stage_ranks)
    ok, tag = True, 0
    for b in range(len(stage_ranks) - 1):
        for la, lb in itertools.product(LAYOUTS, LAYOUTS):
            for shape in [(2, 5, 3), (1, 1, 2), (2, 0, 3)]:  # uneven blocks, an empty block, no elements
                tag += 1
                ok &= _transfer(groups, b, b + 1, la, lb, shape, tag, static)  # forward
                ok &= _transfer(groups, b + 1, b, lb, la, shape, -tag, static)  # backward: the same reshard
    assert all_true(ok)


@pytest.mark.world(4, timeout=30)
def test_ledger_messages_of_the_vtp_protocol():
    """Replicated tp=2 -> tp=1 -> tp=1 and back: leader to leader, one header and one payload
    per transfer, a broadcast of header and payload in the tp=2 stage when it receives."""
    groups = _groups([[0, 1], [2], [3]])
    s, i = groups.stage_index, groups.tp_rank
    R = Replicate()
    with CommLedger() as ledger:
        _transfer(groups, 0, 1, R, R, (2, 3, 4), 1, False)
        _transfer(groups, 1, 0, R, R, (2, 3, 4), 2, False)
    sends, recvs, bcasts = (ledger.count(op=o) for o in ("send", "recv", "broadcast"))
    want = {(0, 0): (2, 2, 2), (0, 1): (0, 0, 2), (1, 0): (2, 2, 0), (2, 0): (0, 0, 0)}[(s, i)]
    assert all_true((sends, recvs, bcasts) == want)


@pytest.mark.world(4, timeout=30)
def test_mismatched_stage_layout_raises_on_every_rank():
    good = [[0, 1], [2], [3]]
    tps = [subgroup(tuple(r)) for r in good]
    s = 0 if rank() < 2 else rank() - 1
    mine = [[0, 1], [2, 3]] if rank() == 3 else good  # rank 3 thinks stages 1 and 2 are one
    with pytest.raises(ShardkitError, match=r"ranks \[3\] passed stage_ranks"):
        StageGroups(world_group(), mine, tps[s])
    with pytest.raises(ShardkitError, match="must be non-empty lists that together hold every group rank 0..3"):
        StageGroups(world_group(), [[0, 1], [2]], tps[s])  # sum of tp sizes 3 != 4 ranks
    # A tp group that does not match the stage: rank 2 passes the tp=2 group of stage 0? It is
    # not a member; pass instead the world (size 4) as its stage group.
    wrong = world_group() if rank() == 2 else tps[s]
    with pytest.raises(ShardkitError, match=r"rank 2: its tp_group has size 4 and rank 2, but stage 1"):
        StageGroups(world_group(), good, wrong)
    assert StageGroups(world_group(), good, tps[s]).tp_sizes == (2, 1, 1)


@pytest.mark.world(3, timeout=30)
def test_wrong_static_shape_raises_on_both_stages():
    """Checks on: a sender whose tensor does not match the declared static shape tells the
    receiving stage in the header (both raise); a receiver declaring another shape raises."""
    groups = _groups([[0], [1, 2]])
    src, dst = Side((0,), Replicate()), Side((1, 2), Shard(1))
    s = groups.stage_index
    with checks(True):
        if s == 0:
            with pytest.raises(
                ShardkitError, match=r"declared full \[2, 4, 3\] torch.float64 .* its tensor is \[2, 5, 3\]"
            ):
                send_side(_value((2, 5, 3), 0), src, dst, groups.info, groups.tp, ((2, 4, 3), torch.float64), "t", "f")
        else:
            with pytest.raises(ShardkitError, match=r"the sending stage \(group ranks \[0\]\) reported an error"):
                recv_side(src, dst, groups.info, groups.tp, ((2, 4, 3), torch.float64), torch.device("cpu"), "t", "f")
        if s == 0:
            send_side(_value((2, 5, 3), 0), src, dst, groups.info, groups.tp, ((2, 5, 3), torch.float64), "t", "f")
        else:
            with pytest.raises(ShardkitError, match=r"declared \[2, 4, 3\] torch.float64 but was sent \[2, 5, 3\]"):
                recv_side(src, dst, groups.info, groups.tp, ((2, 4, 3), torch.float64), torch.device("cpu"), "t", "f")
    # Nothing stale: a clean transfer still arrives bitwise.
    assert all_true(_transfer(groups, 0, 1, Replicate(), Shard(1), (2, 5, 3), 7, False))
