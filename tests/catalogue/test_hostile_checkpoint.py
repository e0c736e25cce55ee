"""Issue 31, items 2 and 3, as a user meets them: ``shardkit train`` runs (2 ranks, ``tp=2``,
float64, :func:`shardkit.train.run.train`) on checkpoint directories that rank 0 damages between
runs, as an attacker would.

* item 2: the issue's hash-bomb ``.metadata`` (a 100-level tuple DAG as one item's offset, the
  manifest rewritten to agree) is refused quickly on every rank, naming the file; a manifest
  whose checksums were deleted is refused on every rank unless ``--allow-unverified``;
* item 3: a run whose ``--checkpoint-dir`` gained a link into another root after its check
  before launch refuses once it holds the lock, and ``--keep`` never deletes the other root's
  manifest through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from shardkit import ShardkitError
from shardkit.checkpoint import MANIFEST, latest_checkpoint
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

BASE = dict(seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3, tp=2)
METADATA = ".metadata"


def _cfg(**kw) -> TrainConfig:
    cfg = validate_config(TrainConfig(**{**BASE, **kw}), world_size=world_size())
    check_checkpoint_dir(cfg)
    return cfg


def _train(cfg: TrainConfig):
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _on_rank0(fn, *args):
    if rank() == 0:
        fn(*args)
    dist.barrier()


def _plant_hash_bomb(save: str) -> None:
    """One item's offset replaced by ``t = (t, t)`` 100 times (allow-listed types only), the
    manifest's hash of ``.metadata`` rewritten to agree."""
    md = FileSystemReader(save).read_metadata()  # a save this test just wrote
    t: tuple = (0,)
    for _ in range(100):
        t = (t, t)
    index = next(iter(md.storage_data))
    object.__setattr__(index, "offset", t)  # after the dict hashed it: nothing hashes t here
    data = pickle.dumps(md, protocol=4)
    with open(os.path.join(save, METADATA), "wb") as f:
        f.write(data)
    manifest = json.load(open(os.path.join(save, MANIFEST)))
    manifest["checksums"]["metadata"] = hashlib.sha256(data).hexdigest()
    with open(os.path.join(save, MANIFEST), "w") as f:
        json.dump(manifest, f)


def _drop_checksums(save: str) -> None:
    manifest = json.load(open(os.path.join(save, MANIFEST)))
    del manifest["checksums"]
    with open(os.path.join(save, MANIFEST), "w") as f:
        json.dump(manifest, f)


@pytest.mark.world(2, timeout=150)
def test_hostile_metadata_and_deleted_checksums_are_refused_on_every_rank():
    root = shared_tmpdir("shardkit-hostile-")
    try:
        _train(_cfg(steps=1, save_every=1, checkpoint_dir=root))
        save = os.path.join(root, "step_00000001")
        good = open(os.path.join(save, METADATA), "rb").read(), open(os.path.join(save, MANIFEST), "rb").read()
        resume = _cfg(steps=2, checkpoint_dir=root, resume=True)
        _on_rank0(_plant_hash_bomb, save)
        start = time.perf_counter()
        with pytest.raises(
            ShardkitError,
            match=rf"load_train_state: checkpoint refused on every rank .*ranks 0, 1: cannot read {save}: "
            rf"{save}/\.metadata is refused unread: memo entry \d+, a container, is used twice",
        ):
            _train(resume)
        assert time.perf_counter() - start < 60
        dist.barrier()

        def restore_without_checksums():
            open(os.path.join(save, METADATA), "wb").write(good[0])
            open(os.path.join(save, MANIFEST), "wb").write(good[1])
            _drop_checksums(save)

        _on_rank0(restore_without_checksums)
        with pytest.raises(
            ShardkitError,
            match=rf"load_train_state: checkpoint refused on every rank .*ranks 0, 1: cannot read {save}: "
            r".*MANIFEST.json has no checksums, .*refused.*--allow-unverified",
        ):
            _train(resume)
        dist.barrier()  # rank 0 releases the lock after the refusal: the next run's check must not see it
        with pytest.warns(UserWarning, match="saved without checksums"):
            result = _train(_cfg(steps=2, checkpoint_dir=root, resume=True, allow_unverified=True))
        assert rank() != 0 or result["first_step"] == 1  # (the result is rank 0's)
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=150)
def test_a_link_planted_after_the_launch_check_is_refused_once_the_run_holds_the_lock():
    """The issue's ``--keep`` loss: ``mine/step_00000000`` a link to ``other``'s complete save;
    the run (checked before the link existed) refuses when it takes the lock, before training,
    and ``other`` keeps its manifest."""
    base = shared_tmpdir("shardkit-linked-")
    other, mine = os.path.join(base, "other"), os.path.join(base, "mine")
    try:
        _train(_cfg(steps=1, checkpoint_dir=other))
        cfg = _cfg(steps=1, keep=1, checkpoint_dir=mine)  # checked while mine did not exist
        _on_rank0(
            lambda: (
                os.makedirs(mine),
                os.symlink(os.path.join(other, "step_00000001"), os.path.join(mine, "step_00000000")),
            )
        )
        with pytest.raises(
            ShardkitError,
            match=r"shardkit train --checkpoint-dir: --checkpoint-dir .*step_00000000: this save is a symbolic "
            r"link to .*other/step_00000001, outside the checkpoint directory .*\(checked again once the lock "
            r"was taken\)",
        ):
            _train(cfg)
        dist.barrier()
        assert os.path.isfile(os.path.join(other, "step_00000001", MANIFEST))
        assert latest_checkpoint(other) == os.path.join(other, "step_00000001")
        assert not os.path.exists(os.path.join(mine, ".lock"))  # released with the refusal
    finally:
        remove_shared_dir(base)
