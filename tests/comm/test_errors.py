"""Bad input: the same ShardkitError on every rank within 2 s, and the group still usable after."""

import time

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank, subgroup, world_group, world_size
from harness.limits import patient
from shardkit import (
    GroupMembershipError,
    ParallelDims,
    RankMismatchError,
    ShardkitError,
    ShardkitTypeError,
    all_gather,
    all_reduce_backward,
    all_reduce_forward,
    all_to_all,
    gather_forward_split_backward,
    reduce_scatter,
    split_forward_gather_backward,
)
from shardkit.comm import checks

G = world_group


def _bad_cases():
    """name -> (expected error type, message fragment, callable). Arguments are the same on
    every rank, so every rank must raise without communicating."""
    x = torch.zeros(4, 6, 3)
    return {
        "scatter_dim_equals_gather_dim": (ShardkitError, "must differ", lambda: all_to_all(x, G(), 1, 1)),
        "dim_out_of_range": (ShardkitError, "out of range", lambda: all_gather(x, G(), dim=3)),
        "negative_dim_out_of_range": (ShardkitError, "out of range", lambda: reduce_scatter(x, G(), dim=-4)),
        "sizes_wrong_length": (
            ShardkitError,
            "entries",
            lambda: reduce_scatter(x, G(), 1, sizes=[6] + [0] * world_size()),
        ),
        "sizes_negative": (
            ShardkitError,
            ">= 0",
            lambda: split_forward_gather_backward(x, G(), 1, sizes=[7, -1] + [0] * (world_size() - 2)),
        ),
        "sizes_not_summing": (
            ShardkitError,
            "sum to",
            lambda: split_forward_gather_backward(x, G(), 1, sizes=[1] * world_size()),
        ),
        "sizes_not_ints": (
            ShardkitTypeError,
            "sequence of ints",
            lambda: reduce_scatter(x, G(), 1, sizes=[6.0] + [0] * (world_size() - 1)),
        ),
        "gather_size_negative": (ShardkitError, ">= 0", lambda: all_to_all(x, G(), 2, 1, gather_size=-4)),
        "gather_size_not_int": (ShardkitTypeError, "gather_size", lambda: all_to_all(x, G(), 2, 1, gather_size=4.0)),
        "grad_scale_unknown": (
            ShardkitError,
            "grad_scale",
            lambda: split_forward_gather_backward(x, G(), 1, grad_scale="sideways"),
        ),
        "grad_scale_on_integer_tensor": (
            ShardkitTypeError,
            "floating",
            lambda: gather_forward_split_backward(torch.zeros(2, 3, dtype=torch.int64), G(), 0, grad_scale="down"),
        ),
        "not_a_tensor": (ShardkitTypeError, "torch.Tensor", lambda: all_reduce_forward([1.0, 2.0], G())),
        "group_none": (ShardkitTypeError, "group is required", lambda: all_gather(x, None, 0)),
        "group_wrong_type": (ShardkitTypeError, "ProcessGroup", lambda: all_gather(x, "tp", 0)),
        "mesh_degrees_not_multiplying": (
            ShardkitError,
            "multiply",
            lambda: ParallelDims(dp_replicate=2, tp=3, world_size=world_size()),
        ),
        "mesh_degree_zero": (ShardkitError, ">= 1", lambda: ParallelDims(tp=0)),
        "mesh_build_wrong_world": (
            ShardkitError,
            "world size",
            lambda: ParallelDims(tp=world_size() + 1).build_mesh("cpu"),
        ),
    }


def _assert_same_error_everywhere(expected_type, fragment, fn):
    start = time.monotonic()
    with pytest.raises(expected_type, match=fragment) as info:
        fn()
    elapsed = time.monotonic() - start
    assert isinstance(info.value, ShardkitError) and isinstance(info.value, ValueError)
    outcomes = [None] * world_size()
    dist.all_gather_object(outcomes, (type(info.value).__name__, str(info.value)), group=G())
    assert all(o == outcomes[0] for o in outcomes), outcomes  # same type and message everywhere
    assert elapsed < 2.0, elapsed
    _assert_group_usable()


def _assert_group_usable():
    t = torch.ones(1)
    dist.all_reduce(t, group=G())
    assert t.item() == world_size()


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "case",
    [
        "scatter_dim_equals_gather_dim",
        "dim_out_of_range",
        "negative_dim_out_of_range",
        "sizes_wrong_length",
        "sizes_negative",
        "sizes_not_summing",
        "sizes_not_ints",
        "gather_size_negative",
        "gather_size_not_int",
        "grad_scale_unknown",
        "grad_scale_on_integer_tensor",
        "not_a_tensor",
        "group_none",
        "group_wrong_type",
        "mesh_degrees_not_multiplying",
        "mesh_degree_zero",
        "mesh_build_wrong_world",
    ],
)
def test_bad_argument_raises_on_every_rank(case):
    _assert_same_error_everywhere(*_bad_cases()[case])


@pytest.mark.world(3)
def test_bad_arguments_at_r3():
    for case in ("scatter_dim_equals_gather_dim", "sizes_not_summing", "grad_scale_unknown"):
        _assert_same_error_everywhere(*_bad_cases()[case])


@pytest.mark.world(2)
def test_group_the_rank_is_not_in():
    # Each rank passes the group holding only the *other* rank; new_group is collective, so both
    # groups are created on both ranks in the same order.
    others = [subgroup((0,)), subgroup((1,))]
    mine_not = others[1 - rank()]
    start = time.monotonic()
    with pytest.raises(GroupMembershipError, match="not a member"):
        all_gather(torch.zeros(2), mine_not, 0)
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    _assert_group_usable()


@pytest.mark.world(2)
def test_two_dim_mesh_is_rejected():
    from harness.helpers import get_mesh

    mesh = get_mesh((1, 2), ("dp", "tp"))
    _assert_same_error_everywhere(ShardkitTypeError, "1-D DeviceMesh", lambda: all_gather(torch.zeros(2), mesh, 0))
    assert torch.equal(all_gather(torch.ones(1) * rank(), mesh["tp"], 0), torch.tensor([0.0, 1.0]))


# Rank-dependent bad input: only the check mode can make every rank raise.
def _rank_dependent_cases():
    r = rank()
    return {
        "dtype_mismatch": (
            "dtype",
            lambda: all_reduce_forward(torch.zeros(3, dtype=torch.float64 if r else torch.float32), G()),
        ),
        "trailing_shape_mismatch": ("shape", lambda: all_gather(torch.zeros(2, 3 + r), G(), 0)),
        "ndim_mismatch": ("ndim", lambda: all_gather(torch.zeros(*([2] * (2 + r))), G(), 0)),
        "local_size_vs_sizes": (
            "expects",
            lambda: all_gather(torch.zeros(2, 3), G(), 0, sizes=[2, 1] + [0] * (world_size() - 2)),
        ),
        # Megatron's f on one rank, g on the other: same shapes, different ops
        "op_identity": (
            "disagree on op",
            lambda: (all_reduce_backward if r else all_reduce_forward)(torch.zeros(3), G()),
        ),
        "gather_size_vs_local": (
            "expects",
            lambda: all_to_all(torch.zeros(2, 2 + (r == 1), 4), G(), 2, 1, gather_size=4 + world_size()),
        ),
        "argument_mismatch": ("arguments", lambda: reduce_scatter(torch.zeros(4, 4), G(), dim=r % 2)),
    }


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "case",
    [
        "dtype_mismatch",
        "trailing_shape_mismatch",
        "ndim_mismatch",
        "local_size_vs_sizes",
        "op_identity",
        "gather_size_vs_local",
        "argument_mismatch",
    ],
)
def test_cross_rank_mismatch_caught_by_check_mode(case):
    fragment, fn = _rank_dependent_cases()[case]
    with checks(True):
        _assert_same_error_everywhere(RankMismatchError, fragment, fn)


@pytest.mark.world(3)
def test_check_mode_passes_good_input_and_costs_one_metadata_gather():
    from shardkit.comm import CommLedger

    x = torch.ones(2, [3, 2, 2][rank()], 3, requires_grad=True)
    with checks(True), CommLedger() as ledger:
        y = all_gather(x, G(), 1, sizes=[3, 2, 2])
        y.sum().backward()
    assert y.shape == (2, 7, 3)
    assert ledger.count(op="metadata_all_gather") == 1 and ledger.count(phase="check") == 1
    assert ledger.count() == 3
