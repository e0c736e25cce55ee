"""Checkpoint IO without the CLI: ``save_train_state`` / ``load_train_state`` on a 2-rank world.

A tiny float64 Hugging Face Llama takes one AdamW step at ``tp=2`` and is saved (model, AdamW
moments, step, an extra tensor). A fresh model of other weights at another layout (``dp_replicate
= 2``: tp 1, each rank half the batch) loads it and takes the second step: its full parameters
equal a one-process run of both steps (1e-10), so the weights and the AdamW state came back
through the changed layout. The check can fail: the same second step from the saved weights with
fresh AdamW state lands elsewhere (asserted). A save whose bytes changed afterwards (an item of a
data file, or ``.metadata``) is refused on every rank before anything is used.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness.helpers import all_true, rank, remove_shared_dir, shared_tmpdir
from harness.tiny_lm import loss_sum, predicted_tokens, tiny_decoder, token_ids
from shardkit import ShardkitError
from shardkit.checkpoint import latest_checkpoint, load_train_state, save_train_state
from shardkit.parallelize import gather_full_parameters, parallelize
from shardkit.sharding import ParallelDims

BATCH, LR = 4, 1e-2
FIRST, SECOND = token_ids(BATCH, seed=1), token_ids(BATCH, seed=2)


def _step(pm, optimizer, ids: torch.Tensor) -> None:
    """One AdamW step on this rank's rows of the global batch ``ids``."""
    dp, r = (1, 0) if pm.mesh is None else (pm.mesh.size("dp"), pm.mesh.local_rank("dp"))
    rows = ids[r * BATCH // dp : (r + 1) * BATCH // dp]
    (loss_sum(pm.module(input_ids=rows).logits, rows) / predicted_tokens(ids)).backward()
    pm.grads.reduce()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _parallel(layout: dict | None, seed: int = 0):
    mesh = None if layout is None else ParallelDims(**layout).build_mesh("cpu")
    pm = parallelize(tiny_decoder(seed=seed), mesh, grad_reduce="sum")  # the loss is over the global count
    return pm, torch.optim.AdamW(pm.module.parameters(), lr=LR)


def _save_after_one_step(root: str) -> str:
    pm, optimizer = _parallel(dict(tp=2))
    _step(pm, optimizer, FIRST)
    return save_train_state(root, pm, optimizer, 1, {"position": torch.tensor([7])}, layout="tp=2")


def _one_process(fresh_adam_for_step_2: bool) -> dict[str, torch.Tensor]:
    pm, optimizer = _parallel(None)
    _step(pm, optimizer, FIRST)
    if fresh_adam_for_step_2:
        optimizer = torch.optim.AdamW(pm.module.parameters(), lr=LR)
    _step(pm, optimizer, SECOND)
    return {n: p.detach().clone() for n, p in pm.module.named_parameters()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


@pytest.mark.world(2, timeout=180)
def test_save_at_tp2_load_at_dp2_continues_like_one_process():
    root = shared_tmpdir("shardkit-train-state-")
    try:
        path = _save_after_one_step(root)
        assert latest_checkpoint(root) == path
        pm, optimizer = _parallel(dict(dp_replicate=2), seed=5)  # other weights, overwritten by the load
        extra = {"position": torch.zeros(1, dtype=torch.int64)}
        assert load_train_state(path, pm, optimizer, extra) == 1
        assert extra["position"].item() == 7
        _step(pm, optimizer, SECOND)
        full = gather_full_parameters(pm)
        ok = True
        if rank() == 0:
            want = _one_process(fresh_adam_for_step_2=False)
            error, control = _worst(full, want), _worst(_one_process(fresh_adam_for_step_2=True), want)
            ok = error < 1e-10 and control > 1e-4
            assert ok, f"resumed error {error:.3g}; with fresh AdamW state {control:.3g}"
        assert all_true(ok)
    finally:
        remove_shared_dir(root)


def _tamper(path: str, what: str) -> None:
    """Flip one byte of a data file's middle, or of ``.metadata`` (rank 0; then a barrier)."""
    if rank() == 0:
        names = sorted(n for n in os.listdir(path) if n.endswith(".distcp")) if what == "data" else [".metadata"]
        file = os.path.join(path, names[0])
        with open(file, "r+b") as f:
            f.seek(os.path.getsize(file) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x55]))
    dist.barrier()


@pytest.mark.world(2, timeout=180)
@pytest.mark.parametrize("what, message", [("data", "differs from its checksum"), (".metadata", "SHA-256 mismatch")])
def test_a_tampered_save_is_refused_on_every_rank(what, message):
    root = shared_tmpdir("shardkit-train-state-")
    try:
        path = _save_after_one_step(root)
        _tamper(path, what)
        pm, optimizer = _parallel(dict(tp=2), seed=5)
        before = {n: p.detach().clone() for n, p in pm.module.named_parameters()}
        with pytest.raises(ShardkitError) as err:
            load_train_state(path, pm, optimizer, {"position": torch.zeros(1, dtype=torch.int64)})
        # every rank names the changed bytes (the reading rank's error travels to the others)
        assert all_true(message in str(err.value) and path in str(err.value)), str(err.value)
        untouched = all(torch.equal(p, before[n]) for n, p in pm.module.named_parameters())
        assert all_true(untouched or what == "data"), "a refused .metadata must leave the model as it was"
    finally:
        remove_shared_dir(root)
