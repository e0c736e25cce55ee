"""ZeRO checkpoints: the sharded AdamW state saved and resumed, on the same layout and across.

Float64 runs of :func:`shardkit.train.run.train` in a persistent gloo world: 4 uninterrupted
steps saving after step 2 (and 4), then steps 3-4 resumed from the step-2 save (``--resume-from``,
into a new directory). On the same ZeRO layout the resumed losses are bitwise those of the
uninterrupted run (every rank's slice of ``exp_avg`` /
``exp_avg_sq``, the parameters, the step, data position and RNG came back; a lost or misplaced
slice changes step 3's update and its loss). Across layouts (ZeRO-2 saved, resumed without ZeRO
under tp; FSDP2 saved, resumed under ZeRO-1) the losses agree to 1e-12: the save holds the full
per-parameter moments, whatever wrote it.
"""

import os

import pytest

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir
from harness.resume import run_losses
from harness.resume import run_train as _run_train
from harness.tiers import tiered

CORPUS = SMALL_CORPUS


def run_train(**kw):
    """:func:`harness.resume.run_train` on :data:`CORPUS` unless ``kw`` names ``data``."""
    return _run_train(**{"data": CORPUS, **kw})


RESUMES = {
    "dp=4 zero 2 -> dp=4 zero 2 (bitwise)": (dict(tp=1, zero=2), dict(tp=1, zero=2), 0.0),
    "pp=2 x dp=2 zero 1 -> same (bitwise)": (dict(tp=1, pp=2, microbatches=2, zero=1),) * 2 + (0.0,),
    "moe ep=2 x dp=2 zero 2 -> same (bitwise, expert slices over edp)": (
        dict(model="moe", ep=2, zero=2),
        dict(model="moe", ep=2, zero=2),
        0.0,
    ),
    "dp=4 zero 2 -> tp=2 x dp=2, no zero": (dict(tp=1, zero=2), dict(tp=2), 1e-12),
    "dp_shard=4 (FSDP2) -> tp=2 x dp=2 zero 1": (dict(tp=1, dp_shard=4), dict(tp=2, zero=1), 1e-12),
}
QUICK = ("dp=4 zero 2 -> dp=4 zero 2 (bitwise)", "dp=4 zero 2 -> tp=2 x dp=2, no zero")


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("first, second, tol", tiered(RESUMES, QUICK))
def test_zero_resume_continues_the_same_losses(first, second, tol):
    root, branch = shared_tmpdir("shardkit-zero-resume-"), shared_tmpdir("shardkit-zero-branch-")
    try:
        # one run is both the uninterrupted reference and the save (a run of its own before): a
        # save that disturbed the run, or a lost or misplaced slice, still parts the two
        full, _ = run_losses(run_train(steps=4, checkpoint_dir=root, save_every=2, **first))
        save = os.path.join(root, "step_00000002")
        resumed, start = run_losses(run_train(steps=4, resume_from=save, checkpoint_dir=branch, **second))
        assert start == 2 and len(resumed) == 2
        if tol == 0.0:
            assert resumed == full[2:], (resumed, full)
        for a, b in zip(resumed, full[2:]):
            assert abs(a - b) <= tol * abs(b), (resumed, full)
        assert rank() != 0 or len(full) == 4
    finally:
        remove_shared_dir(root)
        remove_shared_dir(branch)
