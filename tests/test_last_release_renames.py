"""The keywords the last release renamed keep working for one release, or fail naming the new ones.

``ParallelDims(dp=)`` is ``dp_replicate=`` (the same meaning: replicas whose gradients are
all-reduced); ``ParallelDims(cp=)`` has no single replacement (ring or Ulysses is now a mesh dim),
so it raises. ``RowwiseParallel(split_input=)`` is ``input_layouts=Replicate()`` and
``ColwiseParallel(gather_output=)`` is ``output_layouts=Replicate()``;
``RowwiseParallel(reduce=)`` took any callable, which no layout can stand for, so it raises
naming ``output_layouts``. CHANGELOG.md lists them under "Deprecated".
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from harness.helpers import world_group
from shardkit import ShardkitError
from shardkit.sharding import ParallelDims, Replicate, Shard
from shardkit.tensor_parallel import ColwiseParallel, RowwiseParallel


def test_parallel_dims_dp_is_dp_replicate_and_warns():
    with pytest.warns(DeprecationWarning, match=r"dp_replicate=") as caught:
        dims = ParallelDims(dp=2, tp=2)  # type: ignore[call-arg]
    assert caught[0].filename == __file__  # the warning points at the caller
    assert dims == ParallelDims(dp_replicate=2, tp=2)
    assert dims.dp == 2 and dims.dp_shard == 1 and dims.product == 4


def test_parallel_dims_new_keywords_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ParallelDims(dp_replicate=2, dp_shard=2).dp == 4


def test_parallel_dims_dp_with_dp_replicate_is_refused():
    with pytest.raises(TypeError, match=r"dp_replicate= only"):
        ParallelDims(dp=2, dp_replicate=2)  # type: ignore[call-arg]


def test_parallel_dims_cp_names_its_replacements():
    with pytest.raises(ShardkitError, match=r"cp_ring=.*cp_ulysses=") as err:
        ParallelDims(cp=2)  # type: ignore[call-arg]
    assert isinstance(err.value, TypeError)


def test_parallel_dims_old_dp_still_validates():
    with pytest.warns(DeprecationWarning), pytest.raises(ShardkitError, match=r"dp_replicate must be >= 1"):
        ParallelDims(dp=0)  # type: ignore[call-arg]


@pytest.mark.parametrize("old, new", [(True, Replicate()), (False, Shard(-1))])
def test_rowwise_split_input_is_input_layouts_and_warns(old, new):
    with pytest.warns(DeprecationWarning, match=r"input_layouts=Replicate\(\)"):
        style = RowwiseParallel(split_input=old)
    assert style.input_layouts == new


def test_rowwise_split_input_with_input_layouts_is_refused():
    with pytest.raises(TypeError, match=r"pass one"):
        RowwiseParallel(split_input=True, input_layouts=Replicate())


def test_rowwise_reduce_names_output_layouts():
    with pytest.raises(ShardkitError, match=r"output_layouts=.*Replicate\(\).*Shard\(d\).*Partial\(\)") as err:
        RowwiseParallel(reduce=lambda y: y)
    assert isinstance(err.value, TypeError)


def test_rowwise_new_keywords_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RowwiseParallel(input_layouts=Replicate()).input_layouts == Replicate()


@pytest.mark.parametrize("old, new", [(True, Replicate()), (False, Shard(-1))])
def test_colwise_gather_output_is_output_layouts_and_warns(old, new):
    with pytest.warns(DeprecationWarning, match=r"output_layouts=Replicate\(\)"):
        style = ColwiseParallel(gather_output=old)
    assert style.output_layouts == new


def test_colwise_gather_output_with_output_layouts_is_refused():
    with pytest.raises(TypeError, match=r"pass one"):
        ColwiseParallel(gather_output=True, output_layouts=Replicate())


@pytest.mark.world(2)
def test_colwise_gather_output_gathers_the_output_as_before():
    """The old keyword still does what it did: the full ``[..., out]`` output on every rank."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 6).double()
    layer = copy.deepcopy(ref)
    with pytest.warns(DeprecationWarning):
        ColwiseParallel(gather_output=True).apply(layer, world_group())
    x = torch.randn(3, 4, dtype=torch.float64)
    assert layer.weight.shape == (3, 4) and torch.allclose(layer(x), ref(x), rtol=0, atol=1e-12)
