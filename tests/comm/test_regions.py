"""split_forward_gather_backward / gather_forward_split_backward and their grad_scale conventions.

Each convention is checked as an adjoint identity with the inner products it assumes (see the
module docstring of ``shardkit.comm.regions``), and against a single-process reference loss.
"""

import pytest
import torch

from harness.checks import adjoint_error, coords
from harness.helpers import rank, world_group, world_size
from shardkit import balanced_split_sizes, gather_forward_split_backward, split_forward_gather_backward
from shardkit._shapes import split_offsets
from shardkit.comm import CommLedger

CASES = [(None, 7), ([0, 5], 5), ([3, 0, 4], 7), ([1, 0, 2, 2], 5)]


def _sizes_for(R):
    """Balanced and explicit (zero-size) splits valid at world size R."""
    out = [balanced_split_sizes(7, R)]
    out += [s for s, _ in CASES if s is not None and len(s) == R]
    return out


@pytest.mark.world(2)
@pytest.mark.parametrize("dim", [0, 1])
def test_split_r2(dim):
    _check_split(dim)


@pytest.mark.world(3)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_split_r3(dim):
    _check_split(dim)


@pytest.mark.world(4)
@pytest.mark.parametrize("dim", [1])
def test_split_r4(dim):
    _check_split(dim)


def _check_split(dim):
    g = world_group()
    for sizes in _sizes_for(world_size()):
        shape = [4, 3, 2]
        shape[dim] = sum(sizes)
        full = coords(shape).transpose(0, 2).contiguous().transpose(0, 2)  # replicated, non-contiguous
        y = split_forward_gather_backward(full, g, dim, sizes)
        expected = full.narrow(dim, split_offsets(sizes)[rank()], sizes[rank()])
        assert torch.equal(y, expected) and y.is_contiguous()
        # None: x is one replicated variable counted once; "down": x counted on every rank.
        e_none = adjoint_error(lambda t: split_forward_gather_backward(t, g, dim, sizes), full, rhs_once=True)
        e_down = adjoint_error(lambda t: split_forward_gather_backward(t, g, dim, sizes, grad_scale="down"), full)
        assert e_none <= 1e-12 and e_down <= 1e-12, (sizes, e_none, e_down)


@pytest.mark.world(3)
@pytest.mark.parametrize("dim", [0, 2])
def test_gather_forward_split_backward_r3(dim):
    _check_gather(dim)


@pytest.mark.world(2)
def test_gather_forward_split_backward_r2():
    _check_gather(1)


@pytest.mark.world(4)
def test_gather_forward_split_backward_r4():
    _check_gather(1)


def _check_gather(dim):
    g = world_group()
    for sizes in _sizes_for(world_size()):
        shape = [4, 3, 2]
        shape[dim] = sum(sizes)
        full = coords(shape, offset=1.0)
        local = full.narrow(dim, split_offsets(sizes)[rank()], sizes[rank()])
        assert torch.equal(gather_forward_split_backward(local, g, dim, sizes), full)
        # None: replicated output counted once; "up": the replicated output counted on every rank.
        e_none = adjoint_error(
            lambda t: gather_forward_split_backward(t, g, dim, sizes), local, replicated_cotangent=True, lhs_once=True
        )
        e_up = adjoint_error(
            lambda t: gather_forward_split_backward(t, g, dim, sizes, grad_scale="up"), local, replicated_cotangent=True
        )
        assert e_none <= 1e-12 and e_up <= 1e-12, (sizes, e_none, e_up)


@pytest.mark.world(2)
def test_scales_against_single_process_loss():
    """Sequence-parallel pattern: replicated x -> split -> per-rank loss; the gathered gradient
    equals d(sum of losses)/dx (None) and d(mean of losses)/dx ("down")."""
    g = world_group()
    x_full = coords((2, 6, 3)) / 10
    w = torch.linspace(-1, 1, 3, dtype=torch.float64)
    ref = x_full.clone().requires_grad_()
    (torch.tanh(ref) @ w).pow(2).sum().backward()
    for scale, factor in ((None, 1.0), ("down", 1.0 / world_size())):
        x = x_full.clone().requires_grad_()
        (torch.tanh(split_forward_gather_backward(x, g, 1, grad_scale=scale)) @ w).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad * factor, rtol=1e-12, atol=0)


@pytest.mark.world(3)
def test_ledger_split_and_gather():
    g = world_group()
    x = coords((3, 5)).requires_grad_()
    with CommLedger() as ledger:
        y = split_forward_gather_backward(x, g, 1)
        z = gather_forward_split_backward(y, g, 1, sizes=balanced_split_sizes(5, 3))
        z.sum().backward()
    assert ledger.count(api="split_forward_gather_backward", phase="forward") == 0
    assert ledger.count(api="split_forward_gather_backward", phase="backward") == 1
    assert ledger.count(api="gather_forward_split_backward", phase="forward") == 1
    assert ledger.count(api="gather_forward_split_backward", phase="backward") == 0
    assert ledger.count() == 2
