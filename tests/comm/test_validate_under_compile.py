"""The sized ops' cached checks (``comm/_validate.py``) under ``torch.compile``: no Dynamo warning
about ``functools.lru_cache`` (issue 32: ``--compile`` printed one per op and rank), the same
answers as eager, and the cache still serving eager calls."""

import warnings

import pytest
import torch

from shardkit import ShardkitError
from shardkit.comm import _validate
from shardkit.comm._group import GroupInfo


def _group(size: int, rank: int) -> GroupInfo:
    return GroupInfo(None, size, rank)  # the size checks read the size and the rank only


def _checks(x, g):
    d, sizes = _validate.sharded_dim(x, g, -2, [3, 2], "all_gather")
    e, full = _validate.full_dim(x, g, 1, None, "split")
    return x * d + sizes[g.rank] + full[0] + e


def test_compiled_checks_trace_without_the_cache_warning_and_agree_with_eager():
    g = _group(2, 1)
    x = torch.ones(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(_checks, backend="eager", fullgraph=True)(x, g)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(compiled, _checks(x, g))


def test_eager_calls_still_hit_the_cache_and_a_bad_size_still_raises():
    g = _group(2, 0)
    x = torch.ones(3, 5)
    _validate.sharded_dim(x, g, 0, [3, 4], "all_gather")
    before = _validate._sharded_cached.cache_info().hits
    assert _validate.sharded_dim(x, g, 0, [3, 4], "all_gather") == (0, (3, 4))
    assert _validate._sharded_cached.cache_info().hits == before + 1
    with pytest.raises(ShardkitError, match=r"rank 0 of 2 holds 3 elements along dim 0 but sizes\[0\] = 2"):
        _validate.sharded_dim(x, g, 0, [2, 4], "all_gather")
