"""No warning a user cannot act on (issue 23, item 6): FSDP2 warned "returned a view tensor" on
every step of tp x dp_shard, because the tp gather of the logits returned a view of its buffer."""

from __future__ import annotations

import warnings

import pytest
import torch

from harness.helpers import all_true, rank, world_group
from harness.tiny_lm import loss_sum, tiny_decoder, token_ids
from shardkit.comm import gather_forward_split_backward
from shardkit.parallelize import parallelize
from shardkit.sharding import ParallelDims


@pytest.mark.world(2)
@pytest.mark.parametrize("sizes", [(3, 3), (4, 2), (1, 5)])
def test_a_gather_along_a_later_dim_returns_no_view(sizes):
    x = torch.randn(2, 3, sizes[rank()], requires_grad=True)
    out = gather_forward_split_backward(x, world_group(), dim=-1, sizes=list(sizes))
    assert all_true(out._base is None and out.shape == (2, 3, sum(sizes)))


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_x_fsdp2_step_warns_nothing(sequence_parallel):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = ParallelDims(tp=2, dp_shard=2).build_mesh("cpu")
        pm = parallelize(tiny_decoder(), mesh, sequence_parallel=sequence_parallel)
        ids = token_ids(4)[:2]
        loss_sum(pm.module(input_ids=ids).logits, ids).backward()
    messages = [f"{w.category.__name__}: {str(w.message)[:120]}" for w in caught]
    assert all_true(not messages), messages
