"""Checkpoints in the trainer: save at one layout, resume at another, the same per-step losses.

Float64 runs of :func:`shardkit.train.run.train` in a persistent gloo world: an uninterrupted
run of 3 steps, then 1 step at layout A saved, then steps 2-3 resumed at layout B from that save.
The resumed losses equal the uninterrupted run's to 1e-12 (relative): model, AdamW state, step
count, data position and RNG all came back, through a checkpoint that stores full tensors cut into
the owners' chunks. A failed save leaves the previous one the latest, and it still loads.
"""

import dataclasses
import errno
import json
import os
import time

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
from harness.resume import BASE as _BASE
from harness.resume import run_losses
from harness.resume import run_train as _run_train
from harness.tiers import tiered
from shardkit import ShardkitError
from shardkit.checkpoint import MANIFEST, latest_checkpoint
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
BASE = {**_BASE, "data": CORPUS}


def run_train(**kw):
    """:func:`harness.resume.run_train` on :data:`CORPUS` unless ``kw`` names ``data``."""
    return _run_train(**{"data": CORPUS, **kw})


RESUMES = {
    "tp=2 x dp=2 -> dp_shard=2 x cp_ring=2 (FSDP2)": (dict(), dict(tp=1, dp_shard=2, cp_ring=2)),
    "dp_shard=2 x tp=2 -> pp=2 x dp=2": (dict(dp_shard=2), dict(tp=1, pp=2, microbatches=2)),
    "moe ep=2 (tp=2 x dp=2) -> moe ep=4 (dp_shard=4)": (
        dict(model="moe", ep=2),
        dict(model="moe", tp=1, dp_shard=4, ep=4),
    ),
    # experts FSDP2-sharded over edp=2 saved, resumed replicated (ep=1: tensor-parallel over
    # nothing, FSDP2 over dp_shard) and at ep=4 (edp=1, whole), and back onto edp shards
    "moe ep=2 x dp_shard=2 x tp=2 (experts over edp) -> moe dp_shard=4, ep=1": (
        dict(model="moe", dp_shard=2, ep=2),
        dict(model="moe", tp=1, dp_shard=4),
    ),
    "moe ep=4 (dp_shard=4) -> moe ep=2 x dp_shard=4 (experts over edp)": (
        dict(model="moe", tp=1, dp_shard=4, ep=4),
        dict(model="moe", tp=1, dp_shard=4, ep=2),
    ),
}


# Quick tier: expert weights saved as edp shards beside FSDP2 and tp shards, read back under
# another expert layout (ep 2 -> 1, dense weights resharded 2 x 2 -> 4): every kind of chunk a
# save holds changes owner. Dense weights into ring cp and into pipeline stages (the same dense
# chunks to other owners, 4-6 core-s each), and the other moe cases, are the slow tier's.
QUICK = ("moe ep=2 x dp_shard=2 x tp=2 (experts over edp) -> moe dp_shard=4, ep=1",)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("first,second", tiered(RESUMES, QUICK))
def test_resume_on_another_layout_continues_the_same_losses(first, second):
    root = shared_tmpdir("shardkit-resume-")
    try:
        # 3 steps; 1 saved at A, steps 2-3 resumed at B. The first resumed loss is the loaded
        # model's and the data position's; the second follows a step of the loaded AdamW state
        # (its moments and its step count: bias correction at step 2, not 1).
        full, _ = run_losses(run_train(steps=3, **first))
        run_train(steps=1, checkpoint_dir=root, **first)
        if rank() == 0:
            assert latest_checkpoint(root).endswith("step_00000001")
        resumed, start = run_losses(run_train(steps=3, checkpoint_dir=root, resume=True, **second))
        assert start == 1 and len(resumed) == 2
        for a, b in zip(resumed, full[1:], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b), (resumed, full)
        if rank() == 0:  # the resumed run saved its own last step
            assert latest_checkpoint(root).endswith("step_00000003")
            manifest = json.loads(open(os.path.join(latest_checkpoint(root), MANIFEST)).read())
            assert manifest["step"] == 3 and manifest["layout"]
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_failed_save_keeps_the_previous_checkpoint():
    import torch.distributed.checkpoint as dcp

    root = shared_tmpdir("shardkit-failsave-")
    try:
        run_train(steps=1, tp=2, checkpoint_dir=root)
        real = dcp.FileSystemWriter.write_data

        def broken(self, plan, planner):  # rank 1's disk fills while writing its chunks
            if rank() == 1:
                raise OSError(errno.ENOSPC, "injected", os.path.join(self.path, "__1_0.distcp"))
            return real(self, plan, planner)

        dcp.FileSystemWriter.write_data = broken
        try:  # DCP's CheckpointException (a BaseException), as one ShardkitError with the cause's text
            with pytest.raises(
                ShardkitError,
                match=r"save_train_state: writing .*step_00000002 failed: rank 1: "
                r"No space left on device \[errno 28\]",
            ):
                run_train(steps=2, tp=2, checkpoint_dir=root, resume=True)
        finally:
            dcp.FileSystemWriter.write_data = real
        torch.distributed.barrier()
        if rank() == 0:
            assert latest_checkpoint(root).endswith("step_00000001")  # the previous save is still the latest
        # ... and it loads: resuming continues from step 1
        _, start = run_losses(run_train(steps=2, tp=2, checkpoint_dir=root, resume=True))
        assert start == 1
    finally:
        remove_shared_dir(root)


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ShardkitError, match="--resume, --save-every and --async-checkpoint need --checkpoint-dir"):
        validate_config(TrainConfig(resume=True))


@pytest.mark.world(2, timeout=120)
def test_resume_in_another_dtype_raises_instead_of_casting():
    root = shared_tmpdir("shardkit-dtype-")
    try:
        run_train(steps=1, tp=2, checkpoint_dir=root)  # float64
        # before launch: the manifest's model description
        with pytest.raises(
            ShardkitError,
            match=r"--resume from step_00000001, a save of another model: dtype "
            r"'float64' \(checkpoint\) vs 'float32'",
        ):
            run_train(steps=2, tp=2, checkpoint_dir=root, resume=True, dtype="float32")
        # in the workers, for a save that describes no model (an earlier shardkit's: the run's
        # re-check once it holds the lock passes it, issue 31): the load itself. Every rank has
        # raised on the manifest above before rank 0 edits it: a rank still checking would find
        # no model, pass, and train alone (the hang a loaded CI run met).
        torch.distributed.barrier()
        if rank() == 0:
            file = os.path.join(root, "step_00000001", MANIFEST)
            manifest = json.load(open(file))
            del manifest["model"]
            json.dump(manifest, open(file, "w"))
        torch.distributed.barrier()
        cfg = validate_config(
            TrainConfig(**{**BASE, "steps": 2, "tp": 2, "checkpoint_dir": root, "resume": True}),
            world_size=world_size(),
        )
        with pytest.raises(
            ShardkitError,
            match=r"load_train_state: .*ranks 0, 1: dtypes differ .*"
            r"\(checkpoint float64, model float32\)",
        ):
            train(
                dataclasses.replace(cfg, dtype="float32"),
                "gloo",
                torch.device("cpu"),
                time.perf_counter(),
                progress=False,
            )
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize(
    "holder,message",
    [
        ({"run_id": "r1", "host": "another-host", "pid": 1}, r"in use by run r1 \(pid 1 on host another-host\)"),
        (None, r"in use by an unreadable lock \(being written, or damaged\)"),
    ],
)
def test_a_lock_that_cannot_be_judged_stale_is_refused(holder, message):
    """Another host's lock (its processes cannot be checked from here) and an unreadable one are
    refused on every rank, in the run as before launch; nothing is written."""
    from shardkit.checkpoint.lock import LOCK

    root = shared_tmpdir("shardkit-lock-")
    try:
        cfg = validate_config(
            TrainConfig(**{**BASE, "steps": 1, "tp": 2, "checkpoint_dir": root}), world_size=world_size()
        )
        torch.distributed.barrier()
        if rank() == 0:
            with open(os.path.join(root, LOCK), "w") as f:
                f.write("{" if holder is None else json.dumps(holder))
        torch.distributed.barrier()
        with pytest.raises(ShardkitError, match=message):
            check_checkpoint_dir(cfg)
        with pytest.raises(ShardkitError, match=rf"shardkit train --checkpoint-dir: .*{message}"):
            train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        assert sorted(os.listdir(root)) == [LOCK]
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_resume_says_what_it_continues_from_and_refuses_a_step_count_already_reached():
    """``--resume`` names the step, the save and its layout, or says loudly that it found no save
    (a requeued job's first start trains from step 0); ``--steps`` at or below the saved step is
    an error, not a run that trains nothing and reports a throughput."""
    root = shared_tmpdir("shardkit-resume-says-")
    try:

        def check(**kw):
            return check_checkpoint_dir(
                validate_config(TrainConfig(**{**BASE, "checkpoint_dir": root, **kw}), world_size=world_size())
            )

        assert check(steps=2, resume=True) == f"--resume: no save in {root!r}: this run starts at step 0"
        assert check(steps=2) is None
        run_train(steps=2, checkpoint_dir=root)
        said = check(steps=4, resume=True)
        assert said.startswith(f"--resume: continuing from step 2 of {latest_checkpoint(root)} (saved at ")
        assert said.endswith("(saved at tp=2)")  # the layout of the save
        for steps in (1, 2):
            with pytest.raises(ShardkitError, match=rf"--steps {steps}: the save to resume .* is at step 2 already"):
                check(steps=steps, resume=True)
    finally:
        remove_shared_dir(root)


def test_resume_from_a_path_without_a_save_is_refused(tmp_path):
    """``--resume-from PATH`` fails before launch when PATH holds no save (``--resume`` would start at step 0)."""
    for path, what in ((tmp_path, "holds no save"), (tmp_path / "missing", "does not exist")):
        cfg = validate_config(TrainConfig(**BASE, resume_from=str(path)), world_size=4)
        with pytest.raises(ShardkitError, match=rf"--resume-from '{path}' {what}: expected a checkpoint directory"):
            check_checkpoint_dir(cfg)
    with pytest.raises(ShardkitError, match="--resume and --resume-from .*: give one"):
        validate_config(TrainConfig(**BASE, resume=True, checkpoint_dir=str(tmp_path), resume_from=str(tmp_path)))


@pytest.mark.world(2, timeout=120)
def test_resume_from_one_save_continues_its_losses_into_a_new_directory():
    """``--resume-from ROOT/step_N`` loads that save (not the latest) and saves into its own new
    ``--checkpoint-dir``; the losses after it are the uninterrupted run's."""
    root, branch = shared_tmpdir("shardkit-resume-from-"), shared_tmpdir("shardkit-resume-branch-")
    try:
        full, _ = run_losses(run_train(steps=3))
        run_train(steps=2, checkpoint_dir=root, save_every=1)
        save = os.path.join(root, "step_00000001")
        cfg = validate_config(TrainConfig(**BASE, steps=3, resume_from=save), world_size=world_size())
        assert check_checkpoint_dir(cfg) == f"--resume-from: continuing from step 1 of {save} (saved at tp=2)"
        with pytest.raises(ShardkitError, match="holds the saves of an earlier run .* pass --resume"):
            check_checkpoint_dir(dataclasses.replace(cfg, checkpoint_dir=root))
        resumed, start = run_losses(run_train(steps=3, resume_from=save, checkpoint_dir=branch))
        assert start == 1 and len(resumed) == 2
        for a, b in zip(resumed, full[1:]):
            assert abs(a - b) <= 1e-12 * abs(b), (resumed, full)
        if rank() == 0:
            assert latest_checkpoint(branch).endswith("step_00000003")
            assert latest_checkpoint(root).endswith("step_00000002")  # the source is not touched
    finally:
        remove_shared_dir(root)
        remove_shared_dir(branch)
