"""``parallelize(..., grad_reduce=)``: DDP's mean by default, the trainer's sum on request.

A tiny float64 Hugging Face Llama. Each data rank runs its rows of one global batch (its tokens
with cp) and back-propagates the model's own ``labels=`` loss, the mean over *its* tokens; after
``pm.grads.reduce()`` the global gradient norm must be the one-process norm of the loss over
the whole batch (ratio 1 at 1e-6: transformers computes that loss in float32). Every layout
here gives each data rank the same number of tokens, the condition under which "mean" is the
global token mean. The old code summed over the data ranks: ratio 2 (each test here fails on it).

With cp the model's internal shift would cut across the cp parts, so the labels are shifted on
the full sequence first and passed as ``shift_labels`` (``S + 1`` ids: every position has a
target, so the cp parts count the same number of tokens).

:func:`shardkit.global_mean_loss` covers uneven counts (``-100`` labels on some rows, and the
cp part that holds the sequence's last position): the reduced gradient is the one-process
gradient of the global token mean, where the per-rank mean is not (checked as a control).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.helpers import all_true
from harness.tiny_lm import tiny_decoder, token_ids
from shardkit import ShardkitError, global_mean_loss
from shardkit.parallelize import parallelize
from shardkit.sharding import ParallelDims

BATCH, SEQ = 4, 8
WORLD_2 = {
    "dp_replicate=2": dict(dp_replicate=2),
    "dp_shard=2": dict(dp_shard=2),
    "cp_ring=2": dict(cp_ring=2),
    "cp_ulysses=2": dict(cp_ulysses=2),
}
WORLD_4 = {
    "HSDP dp_replicate=2 x dp_shard=2": dict(dp_replicate=2, dp_shard=2),
    "tp=2 x dp_replicate=2": dict(tp=2, dp_replicate=2),
    "tp=2 x dp_shard=2": dict(tp=2, dp_shard=2),
}


def _norm(model: torch.nn.Module) -> float:
    return torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)).item()


def _rows(ids: torch.Tensor, pm) -> torch.Tensor:
    """This rank's data rows of the global batch."""
    if pm.mesh is None:
        return ids
    n = ids.shape[0] // pm.mesh.size("dp")
    return ids[pm.mesh.local_rank("dp") * n : (pm.mesh.local_rank("dp") + 1) * n]


def _hf_loss(pm, ids: torch.Tensor) -> torch.Tensor:
    """The model's own ``labels=`` loss on this rank's rows (and cp tokens) of ``ids [B, S + 1]``."""
    mine = _rows(ids, pm)
    if pm.cp is None:
        return pm.module(input_ids=mine, labels=mine).loss
    batch = pm.cp.shard_batch(mine[:, :-1])
    targets = pm.cp.shard(mine[:, 1:], batch).contiguous()
    return pm.module(**batch.inputs, labels=targets, shift_labels=targets).loss


def _hf_norm_ratio(layout: dict | None, grad_reduce: str | None) -> float:
    """The parallel model's global gradient norm over the one-process one, HF ``labels=`` loss."""
    ids = token_ids(BATCH, SEQ + 1)
    ref = parallelize(tiny_decoder(), None)
    _hf_loss(ref, ids).backward()
    mesh = ParallelDims(**layout).build_mesh("cpu")
    kw = {} if grad_reduce is None else {"grad_reduce": grad_reduce}
    pm = parallelize(tiny_decoder(), mesh, **kw)
    _hf_loss(pm, ids).backward()
    pm.grads.reduce()
    return pm.grads.global_norm().item() / _norm(ref.module)


@pytest.mark.world(2, timeout=180)
@pytest.mark.parametrize("layout", list(WORLD_2.values()), ids=list(WORLD_2))
def test_hf_labels_loss_gives_the_one_process_gradient_norm_by_default(layout):
    ratio = _hf_norm_ratio(layout, None)
    assert all_true(abs(ratio - 1) < 1e-6), f"norm ratio {ratio}"


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", list(WORLD_4.values()), ids=list(WORLD_4))
def test_hf_labels_loss_gives_the_one_process_gradient_norm_on_four_ranks(layout):
    ratio = _hf_norm_ratio(layout, "mean")
    assert all_true(abs(ratio - 1) < 1e-6), f"norm ratio {ratio}"


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", [dict(dp_replicate=2, dp_shard=2), dict(tp=2, dp_replicate=2)], ids=["HSDP", "tp"])
def test_grad_reduce_sum_keeps_the_sum_over_data_ranks(layout):
    # the sum of per-rank means is (data ranks) x the mean: what every layout gave before the option
    ratio = _hf_norm_ratio(layout, "sum")
    dp = 4 // layout.get("tp", 1)
    assert all_true(abs(ratio - dp) < 1e-6 * dp), f"norm ratio {ratio}, expected {dp}"


def _uneven_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets ``[B, S]`` of ``ids [B, S]`` (``-100`` at the end), more ``-100`` on row 0."""
    t = torch.full_like(ids, -100)
    t[:, :-1] = ids[:, 1:]
    t[0, :5] = -100  # data rank 0 of 2 counts 9 targets, rank 1 counts 14
    return t


def _global_mean_norm_ratio(layout: dict, grad_reduce: str, helper: bool) -> float:
    """Norm ratio for the float64 per-token loss with uneven counts: ``global_mean_loss`` (``helper``)
    or the per-rank token mean (the control)."""
    ids = token_ids(BATCH, SEQ)
    targets = _uneven_targets(ids)
    ref = tiny_decoder()
    logits = ref(input_ids=ids).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    pm = parallelize(tiny_decoder(), ParallelDims(**layout).build_mesh("cpu"), grad_reduce=grad_reduce)
    mine_ids, mine_t = _rows(ids, pm), _rows(targets, pm)
    inputs = {"input_ids": mine_ids}
    if pm.cp is not None:  # the cp part holding the last position has one target fewer
        batch = pm.cp.shard_batch(mine_ids)
        inputs, mine_t = batch.inputs, pm.cp.shard(mine_t, batch)
    logits = pm.module(**inputs).logits.flatten(0, 1)
    if helper:
        loss_sum = F.cross_entropy(logits, mine_t.flatten(), ignore_index=-100, reduction="sum")
        loss = global_mean_loss(loss_sum, int((mine_t != -100).sum()), pm.mesh["dp_cp"], grad_reduce=grad_reduce)
    else:
        loss = F.cross_entropy(logits, mine_t.flatten(), ignore_index=-100)
    loss.backward()
    pm.grads.reduce()
    return pm.grads.global_norm().item() / _norm(ref)


UNEVEN = {"dp_replicate=2": dict(dp_replicate=2), "dp_shard=2": dict(dp_shard=2), "cp=2": dict(cp_ring=2)}


@pytest.mark.world(2, timeout=180)
@pytest.mark.parametrize("grad_reduce", ["mean", "sum"])
@pytest.mark.parametrize("layout", list(UNEVEN.values()), ids=list(UNEVEN))
def test_global_mean_loss_gives_the_global_token_mean_with_uneven_counts(layout, grad_reduce):
    ratio = _global_mean_norm_ratio(layout, grad_reduce, helper=True)
    assert all_true(abs(ratio - 1) < 1e-10), f"norm ratio {ratio}"


@pytest.mark.world(2, timeout=180)
@pytest.mark.parametrize("layout", [dict(dp_replicate=2), dict(cp_ring=2)], ids=["dp", "cp"])
def test_the_per_rank_mean_misses_the_global_mean_with_uneven_counts(layout):
    ratio = _global_mean_norm_ratio(layout, "mean", helper=False)
    assert all_true(abs(ratio - 1) > 1e-3), f"norm ratio {ratio}: the control no longer tells the cases apart"


def test_global_mean_loss_on_one_process_is_the_mean():
    loss_sum = torch.tensor(6.0, dtype=torch.float64)
    assert global_mean_loss(loss_sum, 4, None).item() == 1.5
    assert global_mean_loss(loss_sum, torch.tensor(3), None, grad_reduce="sum").item() == 2.0


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.tensor([1.0]), 2, None), "loss_sum must be a 0-d floating tensor"),
        ((torch.tensor(1), 2, None), "loss_sum must be a 0-d floating tensor"),
        ((torch.tensor(1.0), -1, None), "token_count must be a non-negative int"),
        ((torch.tensor(1.0), torch.ones(2), None), "token_count must be an int or a 0-d real tensor"),
    ],
)
def test_global_mean_loss_refuses_bad_arguments(args, match):
    with pytest.raises(ShardkitError, match=match):
        global_mean_loss(*args)


def test_an_unknown_grad_reduce_is_refused():
    with pytest.raises(ShardkitError, match="parallelize: grad_reduce must be 'mean' or 'sum', got 'avg'"):
        parallelize(tiny_decoder(), None, grad_reduce="avg")
    with pytest.raises(ShardkitError, match="global_mean_loss: grad_reduce must be 'mean' or 'sum'"):
        global_mean_loss(torch.tensor(1.0), 1, None, grad_reduce="average")
