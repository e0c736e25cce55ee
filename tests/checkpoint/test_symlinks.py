"""Issue 31, item 3: no symbolic link is followed out of a checkpoint root.

A save directory, ``latest``, or a file inside a save that resolves outside the root is refused
by load (the resume's ``latest_checkpoint`` and ``read_metadata``), export, the check before
launch and the save's own preparation; retention (``keep``) never unlinks through a link; a
``.lock`` that is a symbolic link is a clear error. Every tree here is built by hand: ``other``
is another run's checkpoint root, whose save must stay intact.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from harness.helpers import world_group
from shardkit import ShardkitError
from shardkit.checkpoint import MANIFEST, export_hf, latest_checkpoint
from shardkit.checkpoint.lock import root_lock
from shardkit.checkpoint.reader import read_metadata
from shardkit.checkpoint.versioned import begin_save, commit_save
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config

LINK = r"is a symbolic link to .*, outside the checkpoint directory"


def _save(path, step: int = 1) -> None:
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"step": step, "hf": {"config": {}}, "checksums": {}}))


def _roots(tmp_path):
    """``other``: a complete save of another root; ``mine``: a root whose ``step_00000001`` is a
    link to it, and whose ``latest`` names that link."""
    other, mine = tmp_path / "other", tmp_path / "mine"
    _save(other / "step_00000001")
    (other / "latest").write_text("step_00000001")
    mine.mkdir()
    os.symlink(other / "step_00000001", mine / "step_00000001")
    (mine / "latest").write_text("step_00000001")
    return other, mine


def test_a_linked_save_is_refused_by_resume_export_and_the_launch_check(tmp_path):
    other, mine = _roots(tmp_path)
    with pytest.raises(ShardkitError, match=rf"mine/step_00000001: this save {LINK}"):
        latest_checkpoint(mine)
    for step in (None, 1):
        with pytest.raises(ShardkitError, match=rf"export: .*mine/step_00000001: this save {LINK}"):
            export_hf(mine, tmp_path / "out", step)
    cfg = validate_config(TrainConfig(tp=1, checkpoint_dir=str(mine), resume=True), world_size=1)
    with pytest.raises(ShardkitError, match=rf"--checkpoint-dir .*mine/step_00000001: this save {LINK}"):
        check_checkpoint_dir(cfg)
    assert (other / "step_00000001" / MANIFEST).exists()


def test_a_linked_latest_is_refused(tmp_path):
    """``latest`` itself a link to another root's pointer (which names a save that ``mine`` holds
    too): refused, not read."""
    other, mine = _roots(tmp_path)
    os.unlink(mine / "step_00000001")
    _save(mine / "step_00000001")
    os.unlink(mine / "latest")
    os.symlink(other / "latest", mine / "latest")
    with pytest.raises(ShardkitError, match=rf"mine/latest: this pointer {LINK}"):
        latest_checkpoint(mine)


@pytest.mark.parametrize("inside", [".metadata", "__0_0.distcp", MANIFEST])
def test_a_file_inside_a_save_linked_outside_it_is_refused(tmp_path, inside):
    save, outside = tmp_path / "save", tmp_path / "outside"
    save.mkdir()
    outside.mkdir()
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([2]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
            )
        },
        storage_data={MetadataIndex("w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, 8)},
    )
    files = {".metadata": pickle.dumps(md), "__0_0.distcp": bytes(8), MANIFEST: b"{}"}
    for name, data in files.items():
        (outside if name == inside else save).joinpath(name).write_bytes(data)
    os.symlink(outside / inside, save / inside)
    what = {".metadata": "metadata file", "__0_0.distcp": "data file", MANIFEST: "manifest"}[inside]
    with pytest.raises(ShardkitError, match=rf"save/{inside}: this {what} {LINK}"):
        if inside == MANIFEST:
            from shardkit.checkpoint.versioned import read_manifest

            read_manifest(save)
        else:
            read_metadata(str(save), None)


@pytest.mark.world(1, timeout=60)
def test_retention_never_deletes_through_a_linked_save(tmp_path):
    """The issue's loss: ``keep=1`` meeting ``step_00000001``, a link into another root, removed
    that root's MANIFEST.json. Now the link alone goes; the other root's save stays complete."""
    other, mine = _roots(tmp_path)
    (mine / "step_00000002").mkdir()
    commit_save(str(mine / "step_00000002"), {"step": 2}, world_group(), keep=1)
    assert (other / "step_00000001" / MANIFEST).exists()
    assert not os.path.lexists(mine / "step_00000001")
    assert latest_checkpoint(mine) == str(mine / "step_00000002")


@pytest.mark.world(1, timeout=60)
def test_a_save_is_never_begun_beside_a_linked_save(tmp_path):
    """Neither written through (a link named like the next save) nor removed as stale."""
    other, mine = _roots(tmp_path)
    (other / "step_00000002").mkdir()  # an incomplete save of the other root: stale-looking
    os.symlink(other / "step_00000002", mine / "step_00000002")
    os.unlink(mine / "step_00000001")
    os.unlink(mine / "latest")
    with pytest.raises(ShardkitError, match=rf"cannot prepare a save in .*mine: .*step_00000002: this save {LINK}"):
        begin_save(str(mine), "step_", world_group(), number=2)
    assert (other / "step_00000002").is_dir()


@pytest.mark.world(1, timeout=60)
def test_a_dangling_lock_link_is_a_clear_error(tmp_path):
    """Not "the lock changed hands; retry" forever: the link is named, before launch and in the run."""
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(tmp_path / "nowhere", root / ".lock")
    message = r"/\.lock is a symbolic link \(to '.*nowhere'\), not a lock shardkit wrote"
    with pytest.raises(ShardkitError, match=rf"shardkit train --checkpoint-dir: .*{message}"):
        with root_lock(root, world_group(), "shardkit train --checkpoint-dir"):
            pass
    cfg = validate_config(TrainConfig(tp=1, checkpoint_dir=str(root)), world_size=1)
    with pytest.raises(ShardkitError, match=rf"--checkpoint-dir .*{message}"):
        check_checkpoint_dir(cfg)
