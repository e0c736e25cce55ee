"""The short host path of the collectives (issue 24): checks cached per shape and argument
types, errors never cached, and the no-graph path issuing the same calls and values."""

import numpy as np
import pytest
import torch

from harness.helpers import rank, world_group, world_size
from shardkit import (
    ShardkitError,
    ShardkitTypeError,
    all_gather,
    all_reduce_forward,
    all_to_all,
    gather_forward_split_backward,
    reduce_scatter,
    split_forward_gather_backward,
)
from shardkit.comm import CommLedger

G = world_group


@pytest.mark.world(2)
def test_cached_checks_tell_argument_types_and_shapes_apart():
    r = world_size()
    x = torch.ones(1, 3)
    all_gather(x, G(), 0, [1] * r)  # the valid call the cache now holds
    # True == 1 and numpy ints hash like ints: a key without their types would accept them.
    for sizes in ([True] * r, [np.int64(1)] * r):
        with pytest.raises(ShardkitTypeError, match="sequence of ints"):
            all_gather(x, G(), 0, sizes)
    with pytest.raises(ShardkitTypeError, match="dim must be an int"):
        all_gather(x, G(), False, [1] * r)
    for _ in range(2):  # a failed check is not cached: the same error every call
        with pytest.raises(ShardkitError, match="holds 2 elements"):
            all_gather(torch.ones(2, 3), G(), 0, [1] * r)
    assert all_gather(x, G(), 0, [1] * r).shape == (r, 3)

    full = torch.ones(r, 3)
    reduce_scatter(full, G(), 0, [1] * r)
    with pytest.raises(ShardkitTypeError, match="sequence of ints"):
        reduce_scatter(full, G(), 0, [True] * r)
    with pytest.raises(ShardkitError, match="sum to"):
        reduce_scatter(torch.ones(r + 1, 3), G(), 0, [1] * r)

    heads = torch.ones(1, 1, r, 2)  # [B, S / R, N, D]
    all_to_all(heads, G(), 2, 1, r)
    with pytest.raises(ShardkitTypeError, match="dim must be an int"):
        all_to_all(heads, G(), 2, True, r)
    for _ in range(2):
        with pytest.raises(ShardkitError, match="balanced split"):
            all_to_all(heads, G(), 2, 1, 3 * r)


def _ops():
    r = world_size()
    return {
        "all_reduce_forward": (lambda t: all_reduce_forward(t, G()), torch.arange(6.0).view(2, 3)),
        "all_gather": (lambda t: all_gather(t, G(), 0, [2] * r), torch.arange(6.0).view(2, 3) + rank()),
        "all_gather_dim1": (lambda t: all_gather(t, G(), 1, [3] * r), torch.arange(6.0).view(2, 3) + rank()),
        "all_gather_uneven": (
            lambda t: all_gather(t, G(), 0, [2 - i % 2 for i in range(r)]),
            torch.arange(3.0 * (2 - rank() % 2)).view(-1, 3),
        ),
        "reduce_scatter": (lambda t: reduce_scatter(t, G(), 0), torch.arange(6.0 * r).view(2 * r, 3)),
        "split": (lambda t: split_forward_gather_backward(t, G(), 0), torch.arange(6.0 * r).view(2 * r, 3)),
        "gather_split": (lambda t: gather_forward_split_backward(t, G(), 1), torch.arange(6.0).view(3, 2) + rank()),
        "all_to_all": (lambda t: all_to_all(t, G(), 2, 1, 2 * r), torch.arange(4.0 * r).view(1, 2, r, 2) + rank()),
    }


@pytest.mark.world(2)
def test_without_a_graph_the_same_calls_and_values_as_with_one():
    for name, (fn, x) in _ops().items():
        with CommLedger() as plain:
            y = fn(x)
        with CommLedger() as graph:
            yg = fn(x.clone().requires_grad_(True))
        assert yg.requires_grad and not y.requires_grad, name
        assert torch.equal(y, yg.detach()), name
        assert plain.records == graph.records and (name == "split") != bool(plain.records), name  # split: local
        with torch.no_grad(), CommLedger() as off:
            y0 = fn(x.clone().requires_grad_(True))
        assert not y0.requires_grad and torch.equal(y0, y) and off.records == plain.records, name


@pytest.mark.world(2)
def test_a_freed_group_leaves_the_resolved_cache():
    """The cache of resolved groups holds no group alive (a destroyed group is freed, and its id,
    which another group may reuse, names nothing)."""
    import gc

    import torch.distributed as dist

    from shardkit.comm import _group

    pg = dist.new_group(ranks=list(range(world_size())))
    key = id(pg)
    info = _group.resolve_group(pg, "t")
    assert _group.resolve_group(pg, "t") == info and info.size == world_size() and info.rank == rank()
    assert key in _group._resolved
    # gloo's connectFullMesh can still be running on the peer when this rank's new_group returns:
    # a barrier on the new group keeps either rank from closing its pairs before both connected.
    dist.barrier(group=pg)
    dist.destroy_process_group(pg)
    del pg, info
    gc.collect()
    assert key not in _group._resolved  # the id may now be reused by another group: it names nothing here
