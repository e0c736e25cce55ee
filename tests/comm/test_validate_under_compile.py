"""The collectives' cached per-shape plans (``comm/_cache.py``: ``_validate``'s size checks,
``_c10d``'s gather / scatter / pack plans, ``all_to_all``'s checks) under ``torch.compile``: no
Dynamo warning about ``functools.lru_cache`` (issue 32: ``--compile`` printed one per cached
function and rank), the same answers as eager, and the cache still serving eager calls."""

import importlib
import pathlib
import re
import warnings

import pytest
import torch

from shardkit import ShardkitError
from shardkit.comm import _c10d, _validate
from shardkit.comm._group import GroupInfo

a2a = importlib.import_module("shardkit.comm.all_to_all")  # the package's all_to_all is the function


def _group(size: int, rank: int) -> GroupInfo:
    return GroupInfo(None, size, rank)  # the size checks read the size and the rank only


def _plans(x, g):
    d, sizes = _validate.sharded_dim(x, g, -2, [3, 2], "all_gather")
    e, full = _validate.full_dim(x, g, 1, None, "split")
    gather = _c10d._gather_plan(tuple(x.shape), 0, (2, 3))
    even, shape = _c10d._scatter_plan(tuple(x.shape), 0, (1, 1), g.rank)
    runs = _c10d._run_table((2, 2, 1))
    order = _c10d._unpack_order(2, (1, 2), x.device)
    return x * d + sizes[g.rank] + full[0] + e + gather.total + shape[0] + len(runs) + int(even) + order.sum()


def test_compiled_plans_trace_without_the_cache_warning_and_agree_with_eager():
    g = _group(2, 1)
    x = torch.ones(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(_plans, backend="eager", fullgraph=True)(x, g)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(compiled, _plans(x, g))


def test_no_bare_lru_cache_is_left_in_the_traced_collectives():
    comm = pathlib.Path(_c10d.__file__).parent
    for name in ("_c10d.py", "_validate.py", "all_to_all.py"):
        assert not re.search(r"@functools\.(lru_cache|cache)\b", (comm / name).read_text()), name
    assert a2a._checked.cache_info().maxsize == 1024  # plan_cache keeps the eager cache's interface


def test_eager_calls_still_hit_the_cache_and_a_bad_size_still_raises():
    g = _group(2, 0)
    x = torch.ones(3, 5)
    _validate.sharded_dim(x, g, 0, [3, 4], "all_gather")
    before = _validate._sharded_cached.cache_info().hits
    assert _validate.sharded_dim(x, g, 0, [3, 4], "all_gather") == (0, (3, 4))
    assert _validate._sharded_cached.cache_info().hits == before + 1
    with pytest.raises(ShardkitError, match=r"rank 0 of 2 holds 3 elements along dim 0 but sizes\[0\] = 2"):
        _validate.sharded_dim(x, g, 0, [2, 4], "all_gather")
