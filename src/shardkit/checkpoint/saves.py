"""The one way every shardkit checkpoint is written and read with DCP (the trainer's
:func:`~shardkit.save_train_state` and :func:`~shardkit.save_sharded_checkpoint` alike).

A save, collective over the group:

1. refused, on every rank and before anything is written, when any rank's state holds a NaN or
   an infinity (the previous save stays the latest);
2. under the root's lock (:mod:`.lock`), prepared by :func:`.versioned.begin_save`;
3. written by DCP; a rank's IO failure is one :class:`~shardkit.ShardkitError` on every rank
   naming the directory and the cause ("No space left on device");
4. every rank hashes the items it wrote (SHA-256 of each item's bytes), rank 0 the
   ``.metadata`` file; the hashes go into the manifest, which :func:`.versioned.commit_save`
   writes last.

A load opens the save (manifest, then ``.metadata`` checked against its hash and unpickled
through the allow-list of :mod:`.reader`), lets the caller refuse a model mismatch, then reads
through :class:`.reader.VerifiedReader` (each item checked as it is read) and refuses loaded
NaNs or infinities, each on every rank.

Source: DCP's ``save`` / ``load`` with a custom storage writer and reader; the manifest-last
commit of :mod:`.versioned`.
"""

from __future__ import annotations

import os
import warnings
from functools import partial
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..comm._group import resolve_group
from ..comm.agree import agree as agree_over
from ..errors import ShardkitError
from .background import BackgroundSaves, check_root
from .integrity import RecordingWriter, agree, dcp_failure, describe_nonfinite, hash_written, nonfinite_keys
from .lock import root_lock
from .reader import METADATA, VerifiedReader, item_key, read_metadata, sha256
from .versioned import begin_save, commit_save, read_manifest

if TYPE_CHECKING:
    import torch

    from .._types import Group

__all__ = ["save_checked", "open_save", "load_checked", "saved_entries"]

ALGORITHM = "sha256"


def save_checked(
    root: str | os.PathLike,
    prefix: str,
    group: Group,
    state: dict[str, torch.Tensor],
    planner,
    manifest: dict,
    op: str,
    *,
    number: int | None = None,
    keep: int | None = None,
    background: BackgroundSaves | None = None,
) -> str:
    """Collective over ``group``: write ``state`` as a new save of ``root``; return its directory.

    Args:
        root: the checkpoint root.
        prefix: the saves' name prefix (``step_``, ``version_``).
        group: every rank writing.
        state: this rank's ``{key: tensor}`` (what ``planner`` writes).
        planner: DCP's save planner.
        manifest: what the manifest holds besides the checksums.
        op: the public function, named in errors.
        number: the save's number (None: the next one).
        keep: complete saves kept, the new one included (None: all).
        background: write behind (:mod:`.background`): the previous background save is
            waited for first, then this one is checked, prepared and staged to CPU memory, and
            the call returns; its write, checksums and commit end by the next
            :meth:`~.background.BackgroundSaves.wait` (the returned directory is the latest
            only then).

    Raises:
        ShardkitError: on every rank: non-finite values in any rank's state (nothing written),
            the root locked by another run, not a checkpoint root, a write that failed (with
            its cause), or a commit that failed; the previous save stays the latest. With
            ``background``, a write or commit failure is raised by the wait that meets it.
    """
    g = resolve_group(group, op)
    if background is not None:
        check_root(background, root, op)
        background.wait()  # its directory has no manifest yet: begin_save would remove it as stale
    bad = describe_nonfinite(nonfinite_keys(state))
    agree(
        bad and f"refused to save {bad}: a checkpoint is never written with them (the previous save stays the latest)",
        group,
        op,
    )
    with root_lock(root, group, op, reuse=True):
        try:
            path = begin_save(root, prefix, group, number=number)
        except ShardkitError as exc:
            raise ShardkitError(f"{op}: {exc}") from None
        writer = RecordingWriter(path)
        finish = partial(_finish, manifest=manifest, op=op, keep=keep)
        if background is not None:
            background.start(path, state, planner, writer, finish)
            return path
        try:
            dcp.save(state, storage_writer=writer, planner=planner, process_group=g.pg)
        except CheckpointException as exc:  # a BaseException: a rank failed, every rank holds its cause
            raise dcp_failure(exc, op, "writing", path) from None
        finish(path, writer, g.pg)
    return path


def _finish(path: str, writer: RecordingWriter, pg, *, manifest: dict, op: str, keep: int | None) -> None:
    """After every rank of ``pg`` wrote ``path``: hash, then commit (manifest, ``latest``, ``keep``)."""
    sums = _gather_checksums(path, writer, resolve_group(pg, op), op)
    commit_save(path, {**manifest, "checksums": sums}, pg, keep=keep)


def _gather_checksums(path: str, writer: RecordingWriter, g, op: str) -> dict:
    """Every rank hashes what it wrote, rank 0 also ``.metadata``; on every rank: the manifest's
    ``checksums`` (or one agreed error)."""
    mine: dict[str, Any] = {}
    error = None
    try:
        mine = hash_written(path, writer)
        if g.rank == 0:
            with open(os.path.join(path, METADATA), "rb") as f:
                mine[METADATA] = sha256(f.read())
    except OSError as exc:
        error = f"reading back {path} to hash it failed: {os.strerror(exc.errno) if exc.errno else exc}"
    everyone = agree_over(g, op, error, mine, gather=True, headline="")
    items = {k: v for hashes in everyone for k, v in hashes.items()}
    return {"algorithm": ALGORITHM, "metadata": items.pop(METADATA), "items": dict(sorted(items.items()))}


def open_save(path: str, allow_unverified: bool = False) -> tuple[dict, Metadata, VerifiedReader]:
    """This rank's view of the save at ``path``: its manifest, its checked DCP metadata and a
    reader verifying each item (no collective; the caller agrees on errors).

    Args:
        path: one save's directory.
        allow_unverified: load a manifest without checksums (a save of an earlier shardkit),
            with a warning; otherwise it is refused (deleting the checksums from a manifest
            must not turn verification off).

    Raises:
        ShardkitError: no or damaged manifest, no checksums (without ``allow_unverified``),
            damaged checksums, ``.metadata`` changed, refused or damaged, or an item without a
            checksum.
    """
    manifest = read_manifest(path)
    if "checksums" not in manifest:
        if not allow_unverified:
            raise ShardkitError(
                f"{os.path.join(path, 'MANIFEST.json')} has no checksums, so the save's bytes cannot be "
                "verified: refused. A save of an earlier shardkit (before checksums) loads with "
                "--allow-unverified (allow_unverified=True); its next save carries them"
            )
        # Written by a shardkit before checksums (0.x saves): the metadata still through the
        # allow-list and the tensors with weights_only, but its bytes cannot be verified.
        warnings.warn(
            f"{path} was saved without checksums (an earlier shardkit): its bytes are not verified; "
            "the next save carries them",
            stacklevel=2,
        )
        metadata = read_metadata(path, None)
        return manifest, metadata, VerifiedReader(path, metadata, None)
    sums = manifest["checksums"]
    if not (
        isinstance(sums, dict)
        and sums.get("algorithm") == ALGORITHM
        and isinstance(sums.get("metadata"), str)
        and isinstance(sums.get("items"), dict)
    ):
        raise ShardkitError(
            f"{os.path.join(path, 'MANIFEST.json')} has damaged checksums: the save cannot be "
            "verified, so it is not loaded"
        )
    metadata = read_metadata(path, sums["metadata"])
    missing = sorted(k for k in map(item_key, metadata.storage_data) if k not in sums["items"])
    if missing:
        raise ShardkitError(f"{path}: {len(missing)} stored item(s) have no checksum in the manifest: {missing[:3]}")
    return manifest, metadata, VerifiedReader(path, metadata, sums["items"])


def saved_entries(metadata: Metadata) -> dict:
    """``{key: (full shape, dtype)}`` of checked DCP metadata (tensors only: :func:`open_save`)."""
    return {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def load_checked(
    state: dict[str, torch.Tensor], reader: VerifiedReader, planner, group: Group, op: str, path: str
) -> None:
    """Collective over ``group``: read the save into ``state`` (each item verified), then
    refuse non-finite values.

    Raises:
        ShardkitError: on every rank: an item that is truncated or differs from its checksum
            (named, with its file), an IO error (with its cause), or a NaN / inf loaded.
    """
    g = resolve_group(group, op)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=g.pg)
    except CheckpointException as exc:
        raise dcp_failure(exc, op, "reading", path) from None
    bad = describe_nonfinite(nonfinite_keys(state))
    agree(bad and f"{path} holds {bad}: refused (a save is never resumed from non-finite state)", group, op)
