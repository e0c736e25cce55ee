"""``--async-checkpoint`` (issue 33, item 5): saves written behind the next steps keep what a
foreground save guarantees.

* Parity: the same float64 run saved in the foreground and in the background writes the same
  bytes (every item's SHA-256 in the two manifests equal), and resuming from the background save
  continues the foreground run bitwise, on tp x dp, FSDP2, pp and ZeRO layouts.
* The write is really behind: a save's write blocked until the next step has started completes
  (a foreground save would wait for it forever, here 20 s, and the flag stays unset).
* A state with a NaN is refused before anything is staged; a write that fails leaves the previous
  save the latest and is raised on every rank at the end of the run.

The SIGKILL during a background write is tests/cli/test_fault_trials.py
(``test_kill_during_an_async_save_then_resume_continues_the_same_losses``).
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardkit.train.run as run_module
from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir
from harness.resume import run_losses
from harness.resume import run_train as _run_train
from harness.tiers import tiered
from shardkit import ShardkitError
from shardkit.checkpoint import MANIFEST, latest_checkpoint
from shardkit.train.config import TrainConfig, parallel_dims, validate_config
from shardkit.train.run import build_parallel_model, build_task, build_train_model, run_training

CORPUS = SMALL_CORPUS


def run_train(**kw):
    """:func:`harness.resume.run_train` on :data:`CORPUS` unless ``kw`` names ``data``."""
    return _run_train(**{"data": CORPUS, **kw})


LAYOUTS = {
    "tp=2 x dp=2": dict(tp=2),
    "FSDP2 dp_shard=4": dict(tp=1, dp_shard=4),
    "pp=2 x dp=2": dict(tp=1, pp=2, microbatches=2),
    "ZeRO-1 tp=2 x dp=2": dict(tp=2, zero=1),
    "ZeRO-2 dp=4": dict(tp=1, zero=2),
}
# Quick tier: FSDP2 (the state's all-gathers run before staging) and pipeline stages (each rank
# saves another part of the model); tp x dp and ZeRO stage the same kind of local tensors.
QUICK = ("FSDP2 dp_shard=4", "pp=2 x dp=2")


def _checksums(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)["checksums"]["items"]


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("kw", tiered(LAYOUTS, QUICK))
def test_async_save_then_resume_equals_sync_save_then_resume_bitwise(kw):
    # Three runs: the foreground one, uninterrupted for 3 steps, saving after each, is both the
    # reference and the sync save (a resume from a foreground save continues it bitwise on the
    # same layout: tests/train/test_resume.py, tests/data_parallel/test_zero_resume.py); the
    # background one saves after steps 1 and 2 and is resumed for step 3.
    roots = {mode: shared_tmpdir(f"shardkit-ackpt-{mode}-") for mode in ("sync", "async")}
    try:
        full = run_losses(run_train(steps=3, save_every=1, checkpoint_dir=roots["sync"], **kw))[0]
        trained = run_losses(
            run_train(steps=2, save_every=1, checkpoint_dir=roots["async"], async_checkpoint=True, **kw)
        )
        resumed = run_losses(
            run_train(steps=3, checkpoint_dir=roots["async"], resume=True, async_checkpoint=True, **kw)
        )
        assert trained[0] == full[:2]  # the background write did not touch training
        assert resumed == (full[2:], 2), (resumed, full)  # what came back continues the run bitwise
        if rank() == 0:
            for step in ("step_00000001", "step_00000002"):
                a, s = (_checksums(os.path.join(roots[m], step)) for m in ("async", "sync"))
                assert a == s and a, (step, a, s)  # the same bytes in every item
            assert latest_checkpoint(roots["async"]).endswith("step_00000003")
    finally:
        for root in roots.values():
            remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_the_write_runs_while_the_next_step_trains(monkeypatch):
    root = shared_tmpdir("shardkit-ackpt-behind-")
    next_step = threading.Event()
    real_write, real_step = dcp.FileSystemWriter.write_data, run_module.train_step
    steps_begun = []

    def step(*args, **kwargs):
        steps_begun.append(len(steps_begun))
        if len(steps_begun) == 2:
            next_step.set()
        return real_step(*args, **kwargs)

    def held_write(self, plan, planner):
        seen = next_step.wait(20)  # released by step 2; a foreground save would time out here
        held.append(seen)
        return real_write(self, plan, planner)

    held: list[bool] = []
    monkeypatch.setattr(run_module, "train_step", step)
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held_write)
    try:
        run_train(steps=2, save_every=1, tp=2, checkpoint_dir=root, async_checkpoint=True)
        assert held[0] is True, held  # the step-1 save was written while step 2 ran
        dist.barrier()
        if rank() == 0:
            assert latest_checkpoint(root).endswith("step_00000002")
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_a_state_with_a_nan_is_never_saved_in_the_background():
    root = shared_tmpdir("shardkit-ackpt-nan-")
    try:
        base = dict(seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3, tp=2, data=CORPUS)
        cfg = validate_config(
            TrainConfig(**base, steps=2, save_every=1, checkpoint_dir=root, async_checkpoint=True), world_size=2
        )
        device = torch.device("cpu")
        task = build_task(cfg, device)
        pm, loss_scale = build_parallel_model(
            build_train_model(cfg), parallel_dims(cfg).build_mesh("cpu"), cfg, task, device
        )

        def poison(step, loss):
            if step == 1 and rank() == 1:
                with torch.no_grad():
                    next(pm.module.parameters()).view(-1)[0] = float("nan")

        with pytest.raises(
            ShardkitError,
            match=r"save_train_state: rank 1: refused to save non-finite values \(NaN or "
            r"inf\) in model/.*the previous save stays the latest",
        ):
            run_training(pm, task, cfg, loss_scale, on_step=poison)
        dist.barrier()
        assert latest_checkpoint(root).endswith("step_00000001")  # the pending step-1 save was committed
        assert not os.path.exists(os.path.join(root, "step_00000002"))
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_a_failed_background_write_keeps_the_previous_checkpoint(monkeypatch):
    root = shared_tmpdir("shardkit-ackpt-fail-")
    try:
        run_train(steps=1, tp=2, checkpoint_dir=root, async_checkpoint=True)
        real = dcp.FileSystemWriter.write_data

        def broken(self, plan, planner):  # rank 1's disk fills while writing, on the background thread
            if rank() == 1:
                raise OSError(errno.ENOSPC, "injected", os.path.join(self.path, "__1_0.distcp"))
            return real(self, plan, planner)

        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken)
        with pytest.raises(
            ShardkitError,
            match=r"save_train_state: writing .*step_00000002 failed: rank 1: No space left on device \[errno 28\]",
        ):
            run_train(steps=2, tp=2, checkpoint_dir=root, resume=True, async_checkpoint=True)
        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", real)
        dist.barrier()
        if rank() == 0:
            assert latest_checkpoint(root).endswith("step_00000001")
        _, start = run_losses(run_train(steps=2, tp=2, checkpoint_dir=root, resume=True, async_checkpoint=True))
        assert start == 1
    finally:
        remove_shared_dir(root)


def test_async_checkpoint_needs_a_checkpoint_dir():
    with pytest.raises(ShardkitError, match="--async-checkpoint need --checkpoint-dir"):
        validate_config(TrainConfig(async_checkpoint=True, tp=1), world_size=1)


@pytest.mark.world(2, timeout=120)
def test_a_failure_waits_for_the_pending_save_and_keeps_its_error():
    root = shared_tmpdir("shardkit-ackpt-crash-")
    try:
        base = dict(seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3, tp=2, data=CORPUS)
        cfg = validate_config(
            TrainConfig(**base, steps=3, save_every=1, checkpoint_dir=root, async_checkpoint=True), world_size=2
        )
        device = torch.device("cpu")
        task = build_task(cfg, device)
        pm, loss_scale = build_parallel_model(
            build_train_model(cfg), parallel_dims(cfg).build_mesh("cpu"), cfg, task, device
        )

        def crash(step, loss):  # step 2 fails (Ctrl-C takes the same way out) while the step-1 save is behind it
            if step == 1:
                raise RuntimeError("injected failure")

        with pytest.raises(RuntimeError, match="injected failure"):
            run_training(pm, task, cfg, loss_scale, on_step=crash)
        dist.barrier()
        assert latest_checkpoint(root).endswith("step_00000001")  # completed before the run ended
        assert os.path.exists(os.path.join(root, "step_00000001", MANIFEST))
        assert not os.path.exists(os.path.join(root, "step_00000002"))
    finally:
        remove_shared_dir(root)
