"""Sharded checkpoints of tensor-parallel models with ``torch.distributed.checkpoint`` (DCP),
loadable at any tp size.

Each parameter is stored as its full tensor cut into the chunks the ranks own
(:mod:`.chunks`); keys are the unwrapped model's ``state_dict`` keys (full names, shapes of the
full tensors), so a checkpoint does not depend on the tp size that wrote it.

Failure safety: each :func:`save_sharded_checkpoint` writes a new versioned directory and
commits it with a manifest and an atomic ``latest`` pointer (:mod:`.versioned`); a failed or
killed save leaves the previous one loadable. Saves and loads go through :mod:`.saves` (the
root's lock, per-item checksums, the allow-list reading of DCP's pickled ``.metadata``,
non-finite values refused). Loading refuses missing, unexpected and differently typed keys on
every rank (:mod:`.contents`).

Source: PyTorch Distributed Checkpoint's planner interface, as torchtitan and FSDP2 use it for
DTensors.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm._group import resolve_group
from ..errors import ShardkitError
from ..tensor_parallel.gather import unwrap
from . import saves
from .chunks import ChunkLoadPlanner, ChunkSavePlanner, full_shape, owned_ranges
from .contents import check_contents
from .meta import materialize_meta
from .reader import read_metadata
from .saves import load_checked, open_save, save_checked
from .versioned import resolve_checkpoint

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._types import Group

__all__ = ["save_sharded_checkpoint", "load_sharded_checkpoint", "owned_ranges"]

_PREFIX = "version_"


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state-dict tensors (parameters keep their ShardSpec)."""
    return {k: v for k, v in unwrap(model).state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def save_sharded_checkpoint(model: nn.Module, path: str | os.PathLike, group: Group, *, keep: int = 1) -> str:
    """Collective over ``group``: save ``model``'s state dict as a new DCP checkpoint under
    ``path``, each rank writing only the pieces it owns; return the save's directory.

    Sharded parameters ``[..., N_r, ...]`` are stored as their full ``[..., N, ...]`` tensors,
    cut into the owners' chunks; replicated tensors once. Load it at any tp size with
    :func:`load_sharded_checkpoint`.

    Each save is a directory ``path/version_<N>/`` (DCP files, then ``MANIFEST.json`` written
    last), and ``path/latest`` names the newest complete one, replaced atomically
    (:mod:`.versioned`, the trainer's protocol): a kill at any moment leaves
    the previous save loadable, and the next save removes what a killed one left.

    Args:
        model: a model sharded by :func:`~shardkit.apply_tp` (or unsharded), or a DDP wrapper.
        path: the checkpoint root, on a file system every rank of ``group`` shares.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of every rank holding the model (all tp
            and dp ranks, e.g. ``dist.group.WORLD``); each tp group must lie inside it.
        keep: complete saves kept, the new one included (older ones are removed after it is
            the latest).

    Returns:
        The directory of this save.

    Raises:
        ShardkitError: on every rank (nothing is committed; the previous save stays the
            latest): ``path`` is a file or a directory holding other files, another run holds
            its lock, the model holds a NaN or an infinity, a rank failed to write (the cause
            named, e.g. "No space left on device"; the partial save is removed by the next
            save), or the commit failed.
    """
    if keep < 1:
        raise ShardkitError(f"save_sharded_checkpoint: keep must be >= 1, got {keep}")
    g = resolve_group(group, "save_sharded_checkpoint")
    state = _state(model)
    return save_checked(
        path,
        _PREFIX,
        group,
        state,
        ChunkSavePlanner(state),
        {"format": "shardkit.save_sharded_checkpoint", "keys": len(state), "group_size": g.size},
        "save_sharded_checkpoint",
        keep=keep,
    )


def load_sharded_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    group: Group,
    *,
    device: torch.device | str | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
    allow_unverified: bool = False,
) -> nn.Module:
    """Collective over ``group``: fill ``model`` (sharded at any tp size, or unsharded) from a
    checkpoint written by :func:`save_sharded_checkpoint`, each rank reading only its ranges.

    This reads shardkit's own distributed checkpoint (torch DCP), for resuming training at the
    same or another tp size. To start from a Hugging Face safetensors checkpoint (full weights),
    use :func:`~shardkit.checkpoint.load_sharded` instead.

    The model may be on the meta device after ``apply_tp`` (build it under
    ``torch.device("meta")``): its local shards are then allocated on ``device`` first and its
    non-persistent buffers recomputed, as in :func:`~shardkit.checkpoint.load_sharded`.

    Args:
        model: the model, already sharded by :func:`~shardkit.apply_tp` (any tp size).
        path: the checkpoint root written by :func:`save_sharded_checkpoint` (its ``latest``
            save is loaded), or one save's directory.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of every rank loading (e.g. WORLD).
        device: where meta tensors are allocated (default CPU).
        init_buffers: ``fn(module)`` recomputing non-persistent meta buffers (default
            ``model._init_weights``).
        allow_unverified: load a save whose manifest has no checksums (an earlier shardkit's),
            with a warning; refused otherwise.

    Returns:
        ``model``.

    Raises:
        ShardkitError: on every rank of ``group``, before anything is read: no complete
            checkpoint at ``path``, a damaged manifest, a ``.metadata`` that differs from its
            checksum or names a global outside DCP's metadata classes (never unpickled), keys
            of the model missing from it, keys of it in no rank's model, a full shape or a
            dtype that differs (a load never casts). While reading: an item that differs from
            its checksum or is truncated (named), an IO error, or a NaN / inf loaded.
    """
    g = resolve_group(group, "load_sharded_checkpoint")
    state = _state(model)
    saved = error = reader = None
    try:
        path = resolve_checkpoint(path, ".metadata")
        _, metadata, reader = open_save(os.fspath(path), allow_unverified)
        saved = saves.saved_entries(metadata)
    except (OSError, ShardkitError) as exc:
        error = f"cannot read a DCP checkpoint at {path}: {exc}"
    check_contents(
        {k: (tuple(full_shape(t)), t.dtype) for k, t in state.items()},
        saved,
        g.pg,
        "load_sharded_checkpoint",
        read_error=error,
    )
    root = unwrap(model)
    if any(t.is_meta for t in state.values()):
        persistent = {k for k, t in state.items() if not isinstance(t, nn.Parameter)}
        materialize_meta(root, device or "cpu", persistent, init_buffers)
        state = _state(model)
    assert reader is not None  # opened, or check_contents raised on every rank
    load_checked(state, reader, ChunkLoadPlanner(state), group, "load_sharded_checkpoint", os.fspath(path))
    return model


def saved_entries(path: str | os.PathLike) -> dict:
    """Deprecated (removed in the next release): ``{key: (full shape, dtype)}`` of the DCP save
    at ``path``, tensors only, its ``.metadata`` read through the allow-list
    (:func:`shardkit.checkpoint.reader.read_metadata`; a planted pickle is refused, not run).

    Use :func:`shardkit.checkpoint.saves.open_save` and :func:`shardkit.checkpoint.saves.
    saved_entries`, which also check the manifest's checksums.

    Raises:
        ShardkitError: ``.metadata`` unreadable, truncated, or naming a global outside DCP's
            metadata classes.
    """
    warnings.warn(
        "shardkit.tensor_parallel.dcp.saved_entries is deprecated; use shardkit.checkpoint.saves.open_save "
        "and saves.saved_entries (checksums verified)",
        DeprecationWarning,
        stacklevel=2,
    )
    return saves.saved_entries(read_metadata(os.fspath(path), None))
