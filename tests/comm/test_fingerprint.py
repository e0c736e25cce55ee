"""Check-mode fingerprints at the transforms: per-rank seeds, per-rank plans and per-rank inputs
are one RankMismatchError on every rank (naming the ranks and the first differing tensor) within
2 s, the group usable after; identical ranks pass and get the same model as without checks."""

import os
import time

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_group, world_size
from harness.limits import patient
from shardkit import CommLedger
from shardkit.checkpoint import load_sharded
from shardkit.comm import checks
from shardkit.comm.checks import covered
from shardkit.comm.fingerprint import fingerprint
from shardkit.errors import RankMismatchError, ShardkitError
from shardkit.spatial import apply_spatial
from shardkit.tensor_parallel import apply_tp

PLAN = {"0": "colwise", "2": "rowwise"}


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6), nn.LayerNorm(6)).double()


def _same_error_everywhere(fn, fragment: str) -> str:
    start = time.monotonic()
    with checks(True), pytest.raises(RankMismatchError, match=fragment) as info:
        fn()
    assert time.monotonic() - start < patient(2.0)  # 2 s when quiet, stretched by the machine's load
    msgs = [None] * world_size()
    dist.all_gather_object(msgs, str(info.value), group=world_group())
    assert len(set(msgs)) == 1, msgs  # the same message on every rank
    t = torch.ones(1)
    dist.all_reduce(t, group=world_group())  # the group is usable after
    assert t.item() == world_size()
    return msgs[0]


@pytest.mark.world(2)
def test_identical_ranks_pass_and_shard_as_without_checks():
    plain = apply_tp(_mlp(0), world_group(), PLAN, check="off")
    with checks(True), CommLedger() as ledger:
        checked = apply_tp(_mlp(0), world_group(), PLAN, check="off")
    assert ledger.count(phase="check") == 3  # plan errors (none), plan digest, checksums
    for (n, a), (_, b) in zip(plain.named_parameters(), checked.named_parameters()):
        assert torch.equal(a, b), n
    with CommLedger() as ledger:
        apply_tp(_mlp(0), world_group(), PLAN, check="off")
    assert ledger.count() == 0  # check mode off: no fingerprint


@pytest.mark.world(3)
def test_per_rank_seed_is_caught_naming_the_rank_and_parameter():
    seed = 1 if rank() == 2 else 0
    msg = _same_error_everywhere(lambda: apply_tp(_mlp(seed), world_group(), PLAN, check="off"), "ranks \\[2\\]")
    assert "apply_tp" in msg and "first at '0.weight'" in msg and "3 ranks" in msg


@pytest.mark.world(2)
def test_one_changed_element_is_caught():
    model = _mlp(0)
    if rank() == 1:
        with torch.no_grad():
            model[3].bias[4] += 1e-12  # a replicated LayerNorm parameter, one element
    msg = _same_error_everywhere(lambda: apply_tp(model, world_group(), PLAN, check="off"), "ranks \\[1\\]")
    assert "first at '3.bias'" in msg and "1 of 6 tensors differ" in msg


@pytest.mark.world(2)
def test_permuted_values_are_caught():
    model = _mlp(0)
    if rank() == 1:
        with torch.no_grad():
            model[3].weight.copy_(torch.arange(6.0).flip(0))
    else:
        with torch.no_grad():
            model[3].weight.copy_(torch.arange(6.0))  # same sum, other order
    _same_error_everywhere(lambda: apply_tp(model, world_group(), PLAN, check="off"), "first at '3.weight'")


@pytest.mark.world(2)
def test_per_rank_plan_is_caught():
    plan = dict(PLAN, **({"2": "colwise"} if rank() == 1 else {}))
    msg = _same_error_everywhere(lambda: apply_tp(_mlp(0), world_group(), plan, check="off"), "plan")
    assert "ranks [1] differ from rank 0" in msg


@pytest.mark.world(2)
def test_plan_error_on_one_rank_is_raised_on_every_rank():
    """loss_parallel on rank 1 only: its plan fails locally (no lm_head); in check mode rank 0
    raises the same error instead of waiting in the fingerprint."""
    options = {"loss_parallel": True} if rank() == 1 else {}
    start = time.monotonic()
    with checks(True), pytest.raises(ShardkitError, match="raised on rank 1 of 2") as info:
        apply_tp(_mlp(0), world_group(), PLAN, check="off", **options)
    assert time.monotonic() - start < patient(2.0) and "needs the model's output head" in str(info.value)


@pytest.mark.world(2)
def test_apply_spatial_per_rank_seed():
    def build():
        torch.manual_seed(rank())
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1))

    _same_error_everywhere(lambda: apply_spatial(build(), world_group(), -1), "apply_spatial: .*first at '0.weight'")
    torch.manual_seed(0)
    with checks(True):
        apply_spatial(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1)), world_group(), -1)  # identical: passes


@pytest.mark.world(2)
def test_broadcast_input_fingerprint():
    ids = torch.arange(12).reshape(2, 6)
    fingerprint({"input_ids": ids}, world_group(), "my_step")  # identical: passes
    if rank() == 1:
        ids = ids.clone()
        ids[1, 5] = 0
    _same_error_everywhere(lambda: fingerprint({"input_ids": ids}, world_group(), "my_step"), "first at 'input_ids'")


@pytest.mark.world(2)
def test_load_sharded_from_per_rank_checkpoints_is_caught():
    """Each rank reads its own checkpoint (seed = rank): the replicated tensors read whole differ.
    LayerNorm weights are seed-independent, so only the rowwise layer's replicated bias differs."""
    folder = shared_tmpdir("fingerprint-")
    try:
        paths = [os.path.join(folder, f"rank{r}.safetensors") for r in range(2)]
        if rank() == 0:
            for r, path in enumerate(paths):
                safetensors.torch.save_file(_mlp(r).state_dict(), path)
        dist.barrier(group=world_group())
        with checks(True):
            load_sharded(_mlp(0), paths[0], world_group(), PLAN, check="off")  # the same file: passes
        msg = _same_error_everywhere(
            lambda: load_sharded(_mlp(0), paths[rank()], world_group(), PLAN, check="off"),
            "load_sharded: replicated values differ",
        )
        assert "first at '2.bias'" in msg and "1 of 3 tensors differ" in msg
    finally:
        remove_shared_dir(folder)


@pytest.mark.world(2)
def test_parallelize_per_rank_seed_over_data_parallel_replicas():
    """dp_replicate=2: the replicas must start from the same weights (else their averaged
    gradients train two different models)."""
    from shardkit import ParallelDims
    from shardkit.parallelize import parallelize
    from shardkit.train.config import TrainConfig
    from shardkit.train.lm_families import LLAMA
    from shardkit.train.model import build_model

    mesh = ParallelDims(dp_replicate=2).build_mesh("cpu")
    with checks(True):
        parallelize(build_model(TrainConfig(layers=1, seed=0), LLAMA), mesh)  # identical: passes
    msg = _same_error_everywhere(
        lambda: parallelize(build_model(TrainConfig(layers=1, seed=rank()), LLAMA), mesh),
        "parallelize: replicated values differ",
    )
    assert "ranks [1] differ from rank 0, first at 'model.embed_tokens.weight'" in msg


@pytest.mark.world(2)
def test_tp_forward_agrees_once_on_its_replicated_inputs():
    """In check mode a tensor-parallel model's forward agrees once on its inputs over tp (two
    small all-gathers) instead of once per op; tp ranks fed different token ids are caught."""
    from shardkit.train.config import TrainConfig
    from shardkit.train.lm_families import LLAMA
    from shardkit.train.model import build_model

    model = apply_tp(
        build_model(TrainConfig(layers=1, seed=0), LLAMA), world_group(), sequence_parallel=True, check="off"
    )
    ids = torch.arange(16).reshape(2, 8) % 50
    with checks(True), CommLedger() as ledger:
        model(input_ids=ids)
    assert ledger.count(phase="check") == 2 and ledger.count(phase="check", api="LlamaForCausalLM.forward") == 2
    assert ledger.count(op="all_gather_single", phase="forward") > 0  # the ops ran, unchecked one by one
    with checks(True), CommLedger() as ledger:
        model.model.layers[0].mlp.down_proj(torch.ones(2, 8, 64))  # outside the root forward: checked per op
    assert ledger.count(phase="check") > 0
    if rank() == 1:
        ids = ids.flip(1)
    _same_error_everywhere(
        lambda: model(input_ids=ids),
        "LlamaForCausalLM.forward: replicated values differ .* first at 'input_ids'.*tp ranks must get the same inputs",
    )
    assert not covered(world_group())  # the region was left when the forward raised
