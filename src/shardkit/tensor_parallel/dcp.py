"""Sharded checkpoints of tensor-parallel models with ``torch.distributed.checkpoint`` (DCP),
loadable at any tp size.

A :class:`~.spec.ShardSpec` is a list of arbitrary ranges per rank (balanced head splits, packed
``[G_r | U_r]`` parts, KV heads held by several ranks), which DTensor's ``Shard(dim)``
(``torch.chunk`` blocks) cannot describe. So each parameter is described to DCP by its chunks:

* save: every rank writes the pieces of the full tensor it *owns* (for each full index, the first
  rank holding it, as in :func:`~.spec.gather_full`), one DCP chunk per piece with its global
  offsets. The owned pieces of all ranks tile the full tensor exactly, which DCP's global-plan
  check verifies. Replicated tensors (and the identical pieces of other dp replicas) are written
  once: DCP's save-plan deduplication keeps one copy of each ``(key, offsets)``.
* load: every rank asks for each of its local ranges (all of them, replicated heads included);
  DCP's ``create_read_items_for_chunk_list`` intersects them with the saved chunks, whatever tp
  size (or layout) wrote them, and reads straight into views of the local parameter.

Keys are the unwrapped model's ``state_dict`` keys (full names, shapes of the full tensors), so
a checkpoint does not depend on the tp size that wrote it.

Failure safety: each :func:`save_sharded_checkpoint` writes a new versioned directory and
commits it with a manifest and an atomic ``latest`` pointer
(:mod:`shardkit.checkpoint.versioned`); a failed or killed save leaves the previous one loadable.
Saves and loads go through :mod:`shardkit.checkpoint.saves` (the root's lock, per-item checksums,
the allow-list reading of DCP's pickled ``.metadata``, non-finite values refused). Loading
refuses missing, unexpected and differently typed keys on every rank
(:mod:`shardkit.checkpoint.contents`).

Source: PyTorch Distributed Checkpoint's planner interface (``SavePlanner`` / ``LoadPlanner``,
chunk metadata and resharding reads), as torchtitan and FSDP2 use it for DTensors.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..comm._group import resolve_group
from ..errors import ShardkitError
from .checkpoint import materialize_meta
from .gather import unwrap
from .spec import ShardSpec, shard_spec

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._types import Group

__all__ = ["save_sharded_checkpoint", "load_sharded_checkpoint", "owned_ranges", "saved_entries"]

_PREFIX = "version_"

# (global offsets, local view) of one chunk
_Chunk = tuple[tuple[int, ...], torch.Tensor]


def owned_ranges(spec: ShardSpec, rank: int) -> list[tuple[int, int, int]]:
    """``(start, stop, local_pos)`` of the full-index ranges ``rank`` owns: those of its ranges
    no lower rank holds, nor an earlier range of its own (the first holder owns a replicated
    index; a rank may hold a KV head twice). Over all ranks they tile ``[0, spec.full_size)``
    exactly once."""
    earlier = [r for rs in spec.ranges[:rank] for r in rs]
    out, pos = [], 0
    for a, b in spec.ranges[rank]:
        cur = a
        for c, d in sorted(earlier):  # subtract every earlier range from [a, b)
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c, pos + cur - a))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b, pos + cur - a))
        earlier.append((a, b))
        pos += b - a
    return out


def _full_shape(t: torch.Tensor) -> torch.Size:
    spec = shard_spec(t)
    if spec is None:
        return t.shape
    shape = list(t.shape)
    shape[spec.dim] = spec.full_size
    return torch.Size(shape)


def _chunks(t: torch.Tensor, owned: bool) -> list[_Chunk]:
    """The chunks of local tensor ``t`` to write (``owned``) or to read (all local ranges)."""
    spec = shard_spec(t)
    if spec is None:
        return [((0,) * t.dim(), t.detach())]
    rank = resolve_group(spec.group, "checkpoint").rank
    if owned:
        ranges = owned_ranges(spec, rank)
    else:
        ranges, pos = [], 0
        for a, b in spec.ranges[rank]:
            ranges.append((a, b, pos))
            pos += b - a
    out = []
    for a, b, pos in ranges:
        if b > a:
            offsets = [0] * t.dim()
            offsets[spec.dim] = a
            out.append((tuple(offsets), t.detach().narrow(spec.dim, pos, b - a)))
    return out


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state-dict tensors (parameters keep their ShardSpec)."""
    return {k: v for k, v in unwrap(model).state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


class _ChunkSavePlanner(DefaultSavePlanner):
    """Writes each tensor as the chunks this rank owns, at their global offsets."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._state = state
        self._lookup: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, t in self._state.items():
            props = TensorProperties.create_from_tensor(t)
            # SHARD: one of several chunks of fqn (DCP merges them); TENSOR: the whole tensor
            kind = WriteItemType.TENSOR if shard_spec(t) is None else WriteItemType.SHARD
            for offsets, piece in _chunks(t, owned=True):
                self._lookup[(fqn, offsets)] = piece
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=kind,
                        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=_full_shape(t)),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None  # every item this planner wrote has its chunk offset
        return self._lookup[(index.fqn, tuple(index.offset))]


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads every local range of each tensor from whichever saved chunks overlap it."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._targets = {fqn: _chunks(t, owned=False) for fqn, t in state.items()}

    def create_local_plan(self) -> LoadPlan:
        requests = []
        assert self.metadata is not None  # set by set_up_planner before any plan
        for fqn, chunks in self._targets.items():
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in chunks]
            saved = self.metadata.state_dict_metadata[fqn]
            assert isinstance(saved, TensorStorageMetadata)  # load_sharded_checkpoint checked each key first
            requests += create_read_items_for_chunk_list(fqn, saved, local)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        assert index.index is not None  # read items carry the chunk's index
        return self._targets[index.fqn][index.index][1]

    def load_bytes(self, read_item, value) -> None:
        # DCP's default unpickles bytes items (torch.load(weights_only=False)); shardkit writes none
        raise ShardkitError(f"checkpoint: {read_item.dest_index.fqn!r} is a pickled item; shardkit never loads one")


def save_sharded_checkpoint(model: nn.Module, path: str | os.PathLike, group: Group, *, keep: int = 1) -> str:
    """Collective over ``group``: save ``model``'s state dict as a new DCP checkpoint under
    ``path``, each rank writing only the pieces it owns; return the save's directory.

    Sharded parameters ``[..., N_r, ...]`` are stored as their full ``[..., N, ...]`` tensors,
    cut into the owners' chunks; replicated tensors once. Load it at any tp size with
    :func:`load_sharded_checkpoint`.

    Each save is a directory ``path/version_<N>/`` (DCP files, then ``MANIFEST.json`` written
    last), and ``path/latest`` names the newest complete one, replaced atomically
    (:mod:`shardkit.checkpoint.versioned`, the trainer's protocol): a kill at any moment leaves
    the previous save loadable, and the next save removes what a killed one left.

    Args:
        model: a model sharded by :func:`~.apply.apply_tp` (or unsharded), or a DDP wrapper.
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
    from ..checkpoint.saves import save_checked  # shardkit.checkpoint imports this module

    if keep < 1:
        raise ShardkitError(f"save_sharded_checkpoint: keep must be >= 1, got {keep}")
    g = resolve_group(group, "save_sharded_checkpoint")
    state = _state(model)
    return save_checked(
        path,
        _PREFIX,
        group,
        state,
        _ChunkSavePlanner(state),
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
) -> nn.Module:
    """Collective over ``group``: fill ``model`` (sharded at any tp size, or unsharded) from a
    checkpoint written by :func:`save_sharded_checkpoint`, each rank reading only its ranges.

    This reads shardkit's own distributed checkpoint (torch DCP), for resuming training at the
    same or another tp size. To start from a Hugging Face safetensors checkpoint (full weights),
    use :func:`~.checkpoint.load_sharded` instead.

    The model may be on the meta device after ``apply_tp`` (build it under
    ``torch.device("meta")``): its local shards are then allocated on ``device`` first and its
    non-persistent buffers recomputed, as in :func:`~.checkpoint.load_sharded`.

    Args:
        model: the model, already sharded by :func:`~.apply.apply_tp` (any tp size).
        path: the checkpoint root written by :func:`save_sharded_checkpoint` (its ``latest``
            save is loaded), or one save's directory.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of every rank loading (e.g. WORLD).
        device: where meta tensors are allocated (default CPU).
        init_buffers: ``fn(module)`` recomputing non-persistent meta buffers (default
            ``model._init_weights``).

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
    from ..checkpoint.contents import check_contents
    from ..checkpoint.saves import load_checked, open_save, saved_entries
    from ..checkpoint.versioned import resolve_checkpoint

    g = resolve_group(group, "load_sharded_checkpoint")
    state = _state(model)
    saved = error = reader = None
    try:
        path = resolve_checkpoint(path, ".metadata")
        _, metadata, reader = open_save(os.fspath(path))
        saved = saved_entries(metadata)
    except (OSError, ShardkitError) as exc:
        error = f"cannot read a DCP checkpoint at {path}: {exc}"
    check_contents(
        {k: (tuple(_full_shape(t)), t.dtype) for k, t in state.items()},
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
    load_checked(state, reader, _ChunkLoadPlanner(state), group, "load_sharded_checkpoint", os.fspath(path))
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
    import warnings

    from ..checkpoint import saves
    from ..checkpoint.reader import read_metadata

    warnings.warn(
        "shardkit.tensor_parallel.dcp.saved_entries is deprecated; use shardkit.checkpoint.saves.open_save "
        "and saves.saved_entries (checksums verified)",
        DeprecationWarning,
        stacklevel=2,
    )
    return saves.saved_entries(read_metadata(os.fspath(path), None))
