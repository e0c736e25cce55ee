"""halo_exchange: forward by coordinates (bitwise), backward by adjoint, collectives by ledger."""

import pytest
import torch

from harness.checks import adjoint_error, coords
from harness.helpers import rank, world_group, world_size
from shardkit import ShardkitError, ShardkitTypeError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger
from shardkit.spatial import halo_exchange
from shardkit.spatial._plan import build_plan

# Per-rank shard sizes along the exchanged dim, by name (values must be picklable: names only).
SIZES = {
    "balanced": lambda R: balanced_split_sizes(11, R),
    "zero_inside": lambda R: {2: [0, 7], 3: [4, 0, 3], 4: [3, 0, 0, 4]}[R],
    "first_and_last_empty": lambda R: {2: [0, 5], 3: [0, 5, 0], 4: [0, 2, 3, 0]}[R],
    "one_each": lambda R: [1] * R,  # every halo below is wider than a shard
}
# (left, right): symmetric, one-sided, and wider than any neighbour shard.
WIDTHS = [(1, 1), (0, 2), (3, 0), (5, 4)]


def _expected(full: torch.Tensor, dim: int, start: int, stop: int, periodic: bool) -> torch.Tensor:
    """The global positions [start, stop) of ``full`` along ``dim``: wrapped, or zeros outside."""
    n = full.shape[dim]
    q = torch.arange(start, stop)
    if periodic:
        return full.index_select(dim, q % n)
    padded = torch.cat([full.new_zeros(_with(full.shape, dim, 1)), full], dim)  # index 0 = zero
    inside = (q >= 0) & (q < n)
    return padded.index_select(dim, torch.where(inside, q + 1, torch.zeros_like(q)))


def _with(shape, dim, size):
    out = list(shape)
    out[dim] = size
    return out


def _check(sizes, periodic, left, right, dim, transposed=False):
    """Bitwise forward and adjoint of one exchange; ``left`` / ``right`` are per-rank lists."""
    r = rank()
    n, off = sizes[r], split_offsets(sizes)[r]
    full = coords(_with([2, 3, 4], dim, sum(sizes)), offset=1.0)  # no element is 0: zero fill shows
    local = full.narrow(dim, off, n).clone()
    if transposed:  # same logical shape, other strides
        local = local.transpose(0, 2).contiguous().transpose(0, 2)
    out = halo_exchange(local, world_group(), dim, left, right, sizes=sizes, periodic=periodic)
    ok = torch.equal(out, _expected(full, dim, off - left[r], off + n + right[r], periodic))
    err = adjoint_error(
        lambda t: halo_exchange(t, world_group(), dim, left, right, sizes=sizes, periodic=periodic), local
    )
    return ok, err


def _run_grid(case, periodic):
    R = world_size()
    sizes = SIZES[case](R)
    for left, right in WIDTHS:
        for dim in (0, 1, -1):
            ok, err = _check(sizes, periodic, [left] * R, [right] * R, dim, transposed=(dim == 1))
            assert ok, (left, right, dim)
            assert err <= 1e-12, (left, right, dim, err)
    # Per-rank widths: rank r reaches r + 1 to the left and 2R - r to the right.
    ok, err = _check(sizes, periodic, [r + 1 for r in range(R)], [2 * R - r for r in range(R)], 1)
    assert ok and err <= 1e-12, err


@pytest.mark.world(2)
@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_halo_r2(case, periodic):
    _run_grid(case, periodic)


@pytest.mark.world(3)
@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_halo_r3(case, periodic):
    _run_grid(case, periodic)


@pytest.mark.world(4)
@pytest.mark.parametrize("periodic", [False, True])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_halo_r4(case, periodic):
    _run_grid(case, periodic)


@pytest.mark.world(2)
def test_halo_longer_than_the_tensor_wraps_repeatedly():
    # N = 3 over 2 ranks, halos of 7 and 8: the periodic wrap goes round the tensor twice.
    ok, err = _check([2, 1], True, [7, 7], [8, 8], 1)
    assert ok and err <= 1e-12, err


@pytest.mark.world(1)
def test_size_one_group_zeros_or_self_wrap_without_communication():
    x = coords((2, 5), offset=1.0)
    with CommLedger() as ledger:
        out = halo_exchange(x, world_group(), 1, 2, 3)
        wrapped = halo_exchange(x, world_group(), 1, 2, 3, periodic=True)
    assert torch.equal(out, torch.cat([torch.zeros(2, 2), x, torch.zeros(2, 3)], 1).double())
    assert torch.equal(wrapped, x[:, [3, 4, 0, 1, 2, 3, 4, 0, 1, 2]])
    assert ledger.count() == 0
    assert halo_exchange(x, world_group(), 1, 0, 0) is x  # no halo: identity


@pytest.mark.world(3)
def test_ledger_one_all_to_all_each_way_with_exact_bytes():
    local = coords((2, 2, 3)).requires_grad_()  # sizes [2, 2, 2] along dim 1; slab 6 float64
    with CommLedger() as ledger:
        halo_exchange(local, world_group(), 1, 1, 1).sum().backward()
    assert ledger.count(op="all_to_all_single", api="halo_exchange", phase="forward") == 1
    assert ledger.count(op="all_to_all_single", api="halo_exchange", phase="backward") == 1
    assert ledger.count(op="metadata_all_gather", phase="metadata") == 1  # no sizes=: learned
    assert ledger.count() == 3
    remote = {0: 1, 1: 2, 2: 1}[rank()]  # elements this rank receives (borders are zero-filled)
    assert ledger.bytes_received(phase="forward") == ledger.bytes_sent(phase="forward") == remote * 6 * 8
    assert ledger.bytes_sent(phase="backward") == remote * 6 * 8


@pytest.mark.world(2)
def test_no_collective_when_no_rank_needs_a_remote_element():
    # Rank 0 holds nothing; rank 1 only reaches past the global start: zeros, no traffic.
    local = coords((2, [0, 4][rank()])).requires_grad_()
    with CommLedger() as ledger:
        out = halo_exchange(local, world_group(), 1, [0, 2], 0, sizes=[0, 4])
        out.sum().backward()
    assert ledger.count() == 0
    assert out.shape == (2, [0, 6][rank()])
    assert torch.equal(local.grad, torch.ones_like(local))


def test_plans_are_pure_and_shared():
    plan = build_plan((3, 0, 2), ((-4, 1), (0, 0), (2, 9)), "circular")
    assert plan.counts == ((0, 0, 2), (0, 0, 0), (4, 0, 0)) and plan.traffic
    assert build_plan((3, 0, 2), ((-4, 1), (0, 0), (2, 9)), "circular") is plan  # cached


@pytest.mark.world(2)
@pytest.mark.parametrize("case", ["periodic_empty", "negative", "wrong_length", "not_int"])
def test_bad_widths_raise_on_every_rank(case):
    x = torch.zeros(2, 0)
    calls = {
        "periodic_empty": (
            ShardkitError,
            "empty",
            lambda: halo_exchange(x, world_group(), 1, 1, 0, sizes=[0, 0], periodic=True),
        ),
        "negative": (ShardkitError, ">= 0", lambda: halo_exchange(x, world_group(), 1, -1, 0, sizes=[0, 0])),
        "wrong_length": (
            ShardkitError,
            "one per rank",
            lambda: halo_exchange(x, world_group(), 1, [1, 1, 1], 0, sizes=[0, 0]),
        ),
        "not_int": (ShardkitTypeError, "int", lambda: halo_exchange(x, world_group(), 1, 1.5, 0, sizes=[0, 0])),
    }
    kind, fragment, fn = calls[case]
    with pytest.raises(kind, match=fragment):
        fn()
