"""Saves written in the background (``shardkit train --async-checkpoint``): the state is copied
to CPU memory on the caller's thread, DCP's ``async_save`` writes that copy while training goes
on, and the checksums and the commit follow on a thread of their own.

What a background save keeps of a foreground one (:func:`.saves.save_checked`):

* the non-finite check and :func:`.versioned.begin_save` run on the caller's thread, before
  anything is copied: a state holding a NaN or an infinity is refused on every rank, the
  previous save stays the latest;
* the copy is taken right after that check, so the bytes written are the bytes checked;
* the checksums and :func:`.versioned.commit_save` (manifest last, then ``latest``, then
  ``--keep``) run after every rank's write finished, over a process group of their own: until
  the commit, ``latest`` names the previous complete save, and a kill at any moment leaves it
  loadable (a save without a manifest is removed by the next one);
* the root's lock is held from :meth:`BackgroundSaves.__enter__` until the last pending save
  is committed (or failed), in :meth:`BackgroundSaves.__exit__`.

One save at a time: the next save waits for the pending one first (its directory has no
manifest yet, and the next ``begin_save`` would remove it as stale), and so does leaving the
``with`` block, on success or failure. A failed background write is raised, the same
:class:`~shardkit.ShardkitError` on every rank, by the call that waits for it.

Why a process group of its own: the background thread's collectives (DCP's plan exchange,
the checksum gather, the commit's broadcast) would otherwise interleave with the training
step's collectives on the same communicator, in a different order on each rank. It is gloo
(DCP's ``async_save`` needs a CPU backend; the staged tensors are on the CPU).

Source: DCP's ``async_save`` with a custom ``AsyncStager`` (torch 2.11-2.15 take
``async_stager``, ``storage_writer``, ``planner`` and ``process_group`` alike); torchtitan's
async checkpointing (a separate gloo group, one save in flight, waited on before the next).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..comm._group import resolve_group
from ..errors import ShardkitError
from ..sharding import set_shard_spec, shard_spec
from .chunks import set_window, window
from .integrity import RecordingWriter, dcp_failure
from .lock import root_lock

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["BackgroundSaves", "CpuStager"]


class CpuStager:
    """DCP's ``AsyncStager`` protocol: a copy of the state that training cannot change, in CPU
    memory: pinned when the tensor is on an accelerator (its device-to-host copy then runs at
    the link's speed), plain on the CPU. A key's buffer is reused by the next save of the same
    shape and dtype (a fresh multi-MiB CPU block costs a page fault per 4 KiB): the caller
    never stages again before the previous write ended (:class:`BackgroundSaves`).

    Memory: one more copy of this rank's saved state (model and AdamW moments: under FSDP2 its
    shards only, :mod:`.fsdp_shards`), for the run.
    """

    _synchronize_after_execute = False  # stage() returns a finished copy: nothing to wait for

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.staged_bytes = 0  # of the last stage(): what the copy moved

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        """``{key: CPU copy}`` of ``{key: tensor}``; each copy carries its tensor's shard spec."""
        out, moved = {}, 0
        for key, t in state_dict.items():
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
                self._buffers[key] = buf
            buf.copy_(t.detach())
            moved += buf.numel() * buf.element_size()
            # a fresh view per save: the spec and the window (an FSDP2 shard's place) are
            # attributes of the Python object, not of the storage
            out[key] = set_window(set_shard_spec(buf.view(buf.shape), shard_spec(t)), window(t))
        self.staged_bytes = moved
        return out

    def synchronize_staging(self) -> None:
        """Nothing: :meth:`stage` copies synchronously."""

    def close(self) -> None:
        self._buffers.clear()


class BackgroundSaves:
    """Context manager, collective over ``group`` on entry and exit: hold ``root``'s lock and a
    gloo group for background saves; :func:`.saves.save_checked` given it (``background=``)
    returns once the state is staged, and its write, checksums and commit run behind.

    Args:
        root: the checkpoint root every save goes to.
        group: every rank saving (the world for the trainer); every process of the world enters
            (a new process group is made, torch's ``new_group`` rule).
        op: named in errors.
        timeout: of the background group's collectives (default: torch's).

    Raises:
        ShardkitError: on entry, as :func:`.lock.root_lock` (another run holds ``root``); on
            :meth:`wait` and on a clean exit, a background save that failed (the cause named,
            e.g. "No space left on device"; the previous save stays the latest).
    """

    def __init__(self, root: str | os.PathLike, group: Group, op: str, timeout: timedelta | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.group = group
        self.op = op
        self._timeout = timeout
        self._stack = ExitStack()
        self._pending: Future | None = None
        self.stager = CpuStager()

    def __enter__(self) -> BackgroundSaves:
        g = resolve_group(self.group, self.op)
        self._stack.enter_context(root_lock(self.root, self.group, self.op, reuse=True))
        self.pg = dist.new_group(dist.get_process_group_ranks(g.pg), timeout=self._timeout, backend="gloo")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-ckpt")
        return self

    def start(self, path: str, state: dict, planner, writer: RecordingWriter, finish) -> None:
        """Stage ``state`` now and write it into ``path`` behind; then ``finish(path, writer, pg)``
        (checksums and commit) on the background thread. The caller waited (:meth:`wait`) and
        prepared ``path`` (:func:`.versioned.begin_save`)."""
        assert self._pending is None, "BackgroundSaves.start: the previous save was not waited for"
        answer = dcp.async_save(
            state, storage_writer=writer, planner=planner, process_group=self.pg, async_stager=self.stager
        )
        # a stager returning a finished dict gets a Future; newer torch may wrap it in an
        # AsyncSaveResponse whose upload_completion is that Future
        upload = cast(Future, getattr(answer, "upload_completion", answer))
        self._pending = self._pool.submit(self._finish, upload, path, writer, finish)

    def _finish(self, upload: Future, path: str, writer: RecordingWriter, finish) -> str:
        try:
            upload.result()
        except CheckpointException as exc:  # every rank holds every failed rank's cause
            raise dcp_failure(exc, self.op, "writing", path) from None
        finish(path, writer, self.pg)
        return path

    @property
    def pending(self) -> bool:
        """A save is staged and not yet waited for."""
        return self._pending is not None

    def wait(self) -> str | None:
        """Block until the pending save is committed; its directory (None: no save pending).

        Raises:
            ShardkitError: the same on every rank, when the pending save failed (nothing of it is
                the latest).
        """
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.wait()
            else:  # a failure or Ctrl-C: the pending save still ends (committed or not) before the
                try:  # lock goes; the original error is the one raised
                    self.wait()
                except BaseException as late:  # noqa: BLE001 - reported as a note of the original
                    if exc is not None:
                        exc.add_note(f"the background save pending then did not complete: {late}")
        finally:
            self._pool.shutdown(wait=True)
            self.stager.close()
            dist.destroy_process_group(self.pg)
            self._stack.close()


def check_root(background: BackgroundSaves, root: str | os.PathLike, op: str) -> None:
    """Refuse a background save into another root than the one its lock is held for."""
    if background.root != os.path.abspath(os.fspath(root)):
        raise ShardkitError(f"{op}: background saves hold the lock of {background.root}, not of {root}")
