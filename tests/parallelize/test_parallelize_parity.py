"""``parallelize`` on a tiny Hugging Face Llama, without the CLI: loss and gradients equal one process's.

Each rank builds the same float64 model (the trainer's builder, seed 0), parallelizes it on a
4-rank layout with ``grad_reduce="sum"`` (the trainer's convention), runs its data rows of one
global batch (loss = its token losses / the global token count), and after ``pm.grads.reduce()``
takes one SGD step of ``lr = 1``; the full parameters
(gathered) then moved by exactly minus the one-process gradient of the mean loss over the whole
batch, to float64 rounding. The summed loss equals the one-process loss.

The test can fail: with ``dp_replicate=2`` the data-parallel sum is ``GradientSync``'s alone, and
skipping it leaves each replica with half the batch's gradient (checked below).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.helpers import all_true, rank
from harness.tiny_lm import loss_sum, predicted_tokens, tiny_decoder, token_ids
from shardkit.parallelize import gather_full_parameters, parallelize
from shardkit.sharding import ParallelDims

BATCH = 4
LAYOUTS = {
    "tp=2 x dp_shard=2 (FSDP2)": (dict(tp=2, dp_shard=2), False),
    "tp=2 x dp_replicate=2": (dict(tp=2, dp_replicate=2), False),
    "tp=2 x dp_shard=2, sequence parallel": (dict(tp=2, dp_shard=2), True),
}


def _one_process() -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The reference: loss, initial parameters and gradients of the mean loss over the whole batch."""
    model = tiny_decoder()
    ids = token_ids(BATCH)
    loss = loss_sum(model(input_ids=ids).logits, ids) / predicted_tokens(ids)
    loss.backward()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), params, {n: p.grad for n, p in model.named_parameters()}


def _parallel_step(layout: dict, sequence_parallel: bool, sync: bool) -> tuple[float, dict | None]:
    """One step of the parallelized model: the loss summed over the data ranks, and on rank 0 the
    full parameters' change under one SGD step of lr 1 (minus the gradient)."""
    mesh = ParallelDims(**layout).build_mesh("cpu")
    pm = parallelize(tiny_decoder(), mesh, sequence_parallel=sequence_parallel, grad_reduce="sum")
    ids = token_ids(BATCH)
    rows = BATCH // mesh.size("dp")
    mine = ids[mesh.local_rank("dp") * rows : (mesh.local_rank("dp") + 1) * rows]
    loss = loss_sum(pm.module(input_ids=mine).logits, mine) / predicted_tokens(ids)
    loss.backward()
    if sync:
        pm.grads.reduce()
    before = gather_full_parameters(pm)
    before = before and {n: t.clone() for n, t in before.items()}  # a replicated one is the parameter itself
    torch.optim.SGD(pm.module.parameters(), lr=1.0).step()
    after = gather_full_parameters(pm)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp_cp"].get_group())
    if before is None or after is None:
        return total.item(), None
    return total.item(), {n: before[n] - after[n] for n in before}


def _worst_gradient_error(moved: dict, grads: dict) -> float:
    """The largest relative error, over parameters, of the parallel step's gradient."""
    assert moved.keys() == grads.keys()
    return max(((moved[n] - grads[n]).norm() / grads[n].norm()).item() for n in grads)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout,sequence_parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_parallelize_gives_one_process_loss_and_gradients(layout, sequence_parallel):
    loss, moved = _parallel_step(layout, sequence_parallel, sync=True)
    ok = True
    if rank() == 0:
        ref_loss, _, grads = _one_process()
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        error = _worst_gradient_error(moved, grads)
        ok = error < 1e-10
        assert ok, f"gradient relative error {error:.3g}"
    assert all_true(ok)


@pytest.mark.world(4, timeout=180)
def test_the_parity_check_fails_without_the_gradient_sync():
    _, moved = _parallel_step(dict(tp=2, dp_replicate=2), False, sync=False)
    ok = True
    if rank() == 0:
        _, _, grads = _one_process()
        error = _worst_gradient_error(moved, grads)
        ok = error > 0.05  # each replica kept its own half of the batch's gradient
        assert ok, f"without GradientSync.reduce the gradients still matched ({error:.3g})"
    assert all_true(ok)
