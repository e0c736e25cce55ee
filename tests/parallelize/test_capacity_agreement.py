"""``parallelize``'s check-mode agreement covers ``expert_capacity`` (the MoE capacity and drop policy).

Ranks of one ep group that were given different capacities would each drop different (token,
expert) pairs before the exchange and train on silently different tokens. In check mode the
ranks compare their options before the first step: a mismatch must be one
:class:`~shardkit.errors.RankMismatchError` on every rank, naming the option, in a bounded time
(no hang), and the same options must pass.

Two layouts: ``ep`` borrowed from ``dp_shard`` (the data-parallel fingerprint sees it) and ``ep``
borrowed from ``tp`` alone (``dp_cp`` is 1, so only the ep group's own fingerprint can see it).
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from harness.helpers import rank, world_group, world_size
from harness.limits import patient
from harness.tiny_lm import tiny_decoder
from shardkit.comm import checks
from shardkit.errors import RankMismatchError
from shardkit.parallelize import parallelize
from shardkit.sharding import ParallelDims

LAYOUTS = {"ep over dp_shard": dict(dp_shard=2, ep=2), "ep over tp": dict(tp=2, ep=2)}


def _parallelize(layout: dict, capacity: dict | None):
    mesh = ParallelDims(**layout).build_mesh("cpu")
    model = tiny_decoder("moe", experts=4)
    return parallelize(model, mesh, sequence_parallel=False, grad_reduce="sum", expert_capacity=capacity)


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize(
    "theirs",
    [dict(capacity_factor=1.0, drop_policy="probs"), dict(capacity_factor=1.25, drop_policy="position"), None],
    ids=["factor", "policy", "dropless"],
)
def test_capacity_mismatch_is_one_error_on_every_rank(layout, theirs):
    ours = dict(capacity_factor=1.25, drop_policy="probs")
    start = time.monotonic()
    with checks(True), pytest.raises(RankMismatchError, match=r"ranks \[1\] differ from rank 0 in the plan") as info:
        _parallelize(LAYOUTS[layout], theirs if rank() == 1 else ours)
    assert time.monotonic() - start < patient(30.0)  # an error, not a wait for the group's timeout
    msgs = [None] * world_size()
    dist.all_gather_object(msgs, str(info.value), group=world_group())
    assert len(set(msgs)) == 1 and "parallelize" in msgs[0], msgs


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_same_capacity_passes_the_check(layout):
    with checks(True):
        pm = _parallelize(LAYOUTS[layout], dict(capacity_factor=1.25, drop_policy="probs"))
    assert pm.mesh is not None
