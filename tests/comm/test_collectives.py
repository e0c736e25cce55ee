"""all_gather, reduce_scatter, all_reduce_forward/backward: forward by coordinates, backward by adjoint."""

import pytest
import torch

from harness.checks import adjoint_error, coords
from harness.helpers import rank, world_group, world_size
from shardkit import all_gather, all_reduce_backward, all_reduce_forward, balanced_split_sizes, reduce_scatter
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger

SIZE_CASES = {
    "balanced": lambda n, R: balanced_split_sizes(n, R),
    "uneven_with_zero": lambda n, R: [n] + [0] * (R - 1),
    "ragged": lambda n, R: [(r * 2 + 1) % 4 for r in range(R)],
}


def _local_block(full, dim, sizes):
    return full.narrow(dim, split_offsets(sizes)[rank()], sizes[rank()])


@pytest.mark.world(2)
def test_all_gather_even_default_sizes_bitwise():
    full = coords((3, 2 * world_size(), 5))
    local = full.narrow(1, 2 * rank(), 2)
    assert torch.equal(all_gather(local, world_group(), dim=1), full)


@pytest.mark.world(3)
@pytest.mark.parametrize("case", sorted(SIZE_CASES))
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("transposed", [False, True])
def test_all_gather_r3(case, dim, transposed):
    _check_all_gather(case, dim, transposed)


@pytest.mark.world(2)
@pytest.mark.parametrize("case", sorted(SIZE_CASES))
@pytest.mark.parametrize("dim", [0, 2])
@pytest.mark.parametrize("transposed", [False, True])
def test_all_gather_r2(case, dim, transposed):
    _check_all_gather(case, dim, transposed)


@pytest.mark.world(4)
@pytest.mark.parametrize("case", sorted(SIZE_CASES))
@pytest.mark.parametrize("dim", [1, -1])
@pytest.mark.parametrize("transposed", [False, True])
def test_all_gather_r4(case, dim, transposed):
    _check_all_gather(case, dim, transposed)


def _full_shape(dim, total):
    shape = [3, 4, 5]
    shape[dim] = total
    return shape


def _check_all_gather(case, dim, transposed):
    R = world_size()
    sizes = SIZE_CASES[case](7, R)
    full = coords(_full_shape(dim, sum(sizes)), offset=0.5)
    local = _local_block(full, dim, sizes)
    if transposed:  # non-contiguous input with the same logical shape
        local = local.transpose(0, 2).contiguous().transpose(0, 2)
    assert torch.equal(all_gather(local, world_group(), dim=dim, sizes=sizes), full)
    err = adjoint_error(lambda x: all_gather(x, world_group(), dim=dim, sizes=sizes), local.clone())
    assert err <= 1e-12, err


@pytest.mark.world(3)
@pytest.mark.parametrize("case", sorted(SIZE_CASES))
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_reduce_scatter_r3(case, dim):
    _check_reduce_scatter(case, dim)


@pytest.mark.world(2)
@pytest.mark.parametrize("case", sorted(SIZE_CASES))
@pytest.mark.parametrize("dim", [0, 2])
def test_reduce_scatter_r2(case, dim):
    _check_reduce_scatter(case, dim)


@pytest.mark.world(4)
@pytest.mark.parametrize("case", sorted(SIZE_CASES))
@pytest.mark.parametrize("dim", [1, 2])
def test_reduce_scatter_r4(case, dim):
    _check_reduce_scatter(case, dim)


def _check_reduce_scatter(case, dim):
    R = world_size()
    sizes = SIZE_CASES[case](7, R)
    full = coords(_full_shape(dim, sum(sizes)))
    mine = (full * (rank() + 1)).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    out = reduce_scatter(mine, world_group(), dim=dim, sizes=sizes)
    expected = _local_block(full, dim, sizes) * (R * (R + 1) // 2)
    assert torch.equal(out, expected)
    err = adjoint_error(lambda x: reduce_scatter(x, world_group(), dim=dim, sizes=sizes), mine)
    assert err <= 1e-12, err


@pytest.mark.world(2)
def test_all_reduce_r2():
    _check_all_reduce()


@pytest.mark.world(3)
def test_all_reduce_r3():
    _check_all_reduce()


@pytest.mark.world(4)
def test_all_reduce_r4():
    _check_all_reduce()


def _check_all_reduce():
    R = world_size()
    # g: partial sums in, one replicated result out (counted once), gradient passes through.
    x = coords((2, 3)) * (rank() + 1)
    assert torch.equal(all_reduce_forward(x, world_group()), coords((2, 3)) * (R * (R + 1) // 2))
    err = adjoint_error(lambda t: all_reduce_forward(t, world_group()), x, replicated_cotangent=True, lhs_once=True)
    assert err <= 1e-12, err
    # f: one replicated input (counted once) feeding per-rank partial outputs; gradients summed.
    x = coords((2, 3)).transpose(0, 1)
    y = all_reduce_backward(x, world_group())
    assert torch.equal(y, x)
    err = adjoint_error(lambda t: all_reduce_backward(t, world_group()), x, rhs_once=True)
    assert err <= 1e-12, err


@pytest.mark.world(1)
def test_size_one_group_is_identity():
    x = coords((2, 3)).requires_grad_()
    g = world_group()
    with CommLedger() as ledger:
        for fn in (
            lambda t: all_gather(t, g, 1),
            lambda t: reduce_scatter(t, g, 0),
            lambda t: all_reduce_forward(t, g),
            lambda t: all_reduce_backward(t, g),
        ):
            y = fn(x)
            assert y is x
    assert ledger.count() == 0


@pytest.mark.world(2)
@pytest.mark.parametrize("sizes", [None, [3, 1]])
def test_ledger_counts_all_gather_and_reduce_scatter(sizes):
    even = sizes is None
    local = coords((2, 2 if even else [3, 1][rank()], 3)).requires_grad_()
    with CommLedger() as ledger:
        all_gather(local, world_group(), dim=1, sizes=sizes).sum().backward()
    prim_f = "all_gather_single" if even else "all_to_all_single"
    prim_b = "reduce_scatter_single" if even else "all_to_all_single"
    assert ledger.count(api="all_gather", phase="forward") == 1
    assert ledger.count(api="all_gather", phase="backward") == 1
    assert ledger.count(op=prim_f, phase="forward") == 1 and ledger.count(op=prim_b, phase="backward") == 1
    # without sizes, one metadata all-gather learns them; with sizes, none
    assert ledger.count(op="metadata_all_gather", phase="metadata") == (1 if sizes is None else 0)
    assert ledger.count() == 2 + (sizes is None)
    assert ledger.bytes_received(phase="forward") == 2 * 4 * 3 * 8  # the gathered [2, 4, 3] float64


@pytest.mark.world(2)
def test_ledger_counts_all_reduce_f_and_g():
    x = coords((4, 3)).requires_grad_()
    with CommLedger() as ledger:
        all_reduce_forward(x, world_group()).sum().backward()
    assert ledger.count(op="all_reduce", phase="forward") == 1 and ledger.count() == 1
    assert ledger.bytes_sent() == ledger.bytes_received() == 4 * 3 * 8
    with CommLedger() as ledger:
        all_reduce_backward(x, world_group()).sum().backward()
    assert ledger.count(op="all_reduce", api="all_reduce_backward", phase="backward") == 1 and ledger.count() == 1
