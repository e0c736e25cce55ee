"""The adjoint tests can fail: a backward scaled by the world size must be caught."""

from unittest import mock

import pytest

from harness.checks import adjoint_error, coords
from harness.helpers import rank, world_group
from shardkit import all_gather, all_to_all, reduce_scatter
from shardkit.comm import _c10d


def _scaled_backward(real, world):
    """Wrap a private c10d helper so that calls made in backward return R times the result."""

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        return out * world if "backward" in args or kwargs.get("phase") == "backward" else out

    return wrapper


# (private helper whose backward call is mutated, public op under test, local input shape)
CASES = {
    "reduce_scatter": (lambda x: all_gather(x, world_group(), 1, sizes=[2, 1, 0]), lambda r: (2, [2, 1, 0][r], 5)),
    "all_gather": (lambda x: reduce_scatter(x, world_group(), 1, sizes=[2, 1, 0]), lambda r: (2, 3, 5)),
    "all_to_all": (lambda x: all_to_all(x, world_group(), 2, 1, gather_size=3), lambda r: (2, 1, 5)),
}


@pytest.mark.world(3)
@pytest.mark.parametrize("helper", sorted(CASES))
def test_backward_scaled_by_r_fails_the_adjoint_test(helper):
    op, shape = CASES[helper]
    x = coords(shape(rank()), offset=1.0)
    good = adjoint_error(op, x)
    with mock.patch.object(_c10d, helper, _scaled_backward(getattr(_c10d, helper), 3)):
        bad = adjoint_error(op, x)
    assert good <= 1e-12, good
    assert bad > 1e-2, bad  # far outside the 1e-12 tolerance
