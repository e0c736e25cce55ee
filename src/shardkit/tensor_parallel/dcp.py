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

Failure safety: :func:`save_sharded_checkpoint` writes into a fresh sibling directory and renames
it over ``path`` only after every rank has written and DCP has written its ``.metadata``; a
failed save leaves an existing checkpoint at ``path`` untouched.

Source: PyTorch Distributed Checkpoint's planner interface (``SavePlanner`` / ``LoadPlanner``,
chunk metadata and resharding reads), as torchtitan and FSDP2 use it for DTensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import os
import shutil
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..comm._group import resolve_group
from ..errors import ShardkitError
from .checkpoint import agree_on_error, materialize_meta
from .gather import unwrap
from .spec import ShardSpec, shard_spec

if TYPE_CHECKING:
    from collections.abc import Callable
    from .._types import Group

__all__ = ["save_sharded_checkpoint", "load_sharded_checkpoint", "owned_ranges"]

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
                items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=kind,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=props, size=_full_shape(t))))
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


def _broadcast(g, value):
    box = [value]
    if g.size > 1:
        dist.broadcast_object_list(box, group=g.pg, group_src=0)
    return box[0]


def save_sharded_checkpoint(model: nn.Module, path: str | os.PathLike, group: Group) -> None:
    """Collective over ``group``: save ``model``'s state dict as a DCP checkpoint directory,
    each rank writing only the pieces it owns.

    Sharded parameters ``[..., N_r, ...]`` are stored as their full ``[..., N, ...]`` tensors,
    cut into the owners' chunks; replicated tensors once. Load it at any tp size with
    :func:`load_sharded_checkpoint`.

    Args:
        model: a model sharded by :func:`~.apply.apply_tp` (or unsharded), or a DDP wrapper.
        path: the checkpoint directory, on a file system every rank of ``group`` shares. An
            existing checkpoint there is replaced only once the new one is complete (rank 0
            renames it aside, renames the new one in, then deletes the old one; a crash
            between the renames leaves it as ``.<name>.partial-*.old`` next to ``path``).
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of every rank holding the model (all tp
            and dp ranks, e.g. ``dist.group.WORLD``); each tp group must lie inside it.

    Raises:
        ShardkitError: on every rank, when ``path`` is a file or a non-empty directory without a
            DCP checkpoint (nothing is written).
        torch.distributed.checkpoint.api.CheckpointException: a rank failed to write (the
            partial directory is removed; ``path`` is unchanged).
    """
    g = resolve_group(group, "save_sharded_checkpoint")
    path = os.path.abspath(os.fspath(path))
    tmp = error = None
    if g.rank == 0:
        if os.path.exists(path) and not os.path.isdir(path):
            error = f"{path} exists and is not a directory"
        elif os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
            error = f"{path} is a non-empty directory that holds no DCP checkpoint; it would be replaced"
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial-{uuid.uuid4().hex[:12]}")
    tmp, error = _broadcast(g, (tmp, error))
    if error:
        raise ShardkitError(f"save_sharded_checkpoint: {error}")
    state = _state(model)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=_ChunkSavePlanner(state), process_group=g.pg)
    except BaseException:
        if g.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # dcp.save returns only after the coordinator wrote .metadata: the checkpoint is complete.
    if g.rank == 0:
        try:
            old = None
            if os.path.isdir(path):
                old = f"{tmp}.old"
                os.rename(path, old)
            os.rename(tmp, path)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            error = f"the checkpoint is complete in {tmp} but renaming it to {path} failed: {exc}"
    error = _broadcast(g, error)  # also: no rank returns before the rename
    if error:
        raise ShardkitError(f"save_sharded_checkpoint: {error}")


def load_sharded_checkpoint(model: nn.Module, path: str | os.PathLike, group: Group, *,
                            device: torch.device | str | None = None,
                            init_buffers: Callable[[nn.Module], None] | None = None) -> nn.Module:
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
        path: the checkpoint directory.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of every rank loading (e.g. WORLD).
        device: where meta tensors are allocated (default CPU).
        init_buffers: ``fn(module)`` recomputing non-persistent meta buffers (default
            ``model._init_weights``).

    Returns:
        ``model``.

    Raises:
        ShardkitError: on every rank of ``group``: no checkpoint at ``path``, a key of the model
            missing from it, or a full shape that differs.
    """
    g = resolve_group(group, "load_sharded_checkpoint")
    state = _state(model)
    error = None
    try:
        metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
        saved = metadata.state_dict_metadata
        problems = [f"{k} is not in the checkpoint" for k in state if k not in saved]
        problems += [f"{k} is not a tensor in the checkpoint" for k in state
                     if k in saved and not isinstance(saved[k], TensorStorageMetadata)]
        problems += [f"{k} has full shape {list(meta.size)} in the checkpoint, the model {list(_full_shape(t))}"
                     for k, t in state.items() if isinstance(meta := saved.get(k), TensorStorageMetadata)
                     and meta.size != _full_shape(t)]
        error = "; ".join(problems[:8]) or None
    except (OSError, ValueError, RuntimeError) as exc:
        error = f"cannot read a DCP checkpoint at {path}: {exc}"
    agree_on_error(g.pg, error, "load_sharded_checkpoint")
    root = unwrap(model)
    if any(t.is_meta for t in state.values()):
        persistent = {k for k, t in state.items() if not isinstance(t, nn.Parameter)}
        materialize_meta(root, device or "cpu", persistent, init_buffers)
        state = _state(model)
    dcp.load(state, storage_reader=dcp.FileSystemReader(os.fspath(path)), planner=_ChunkLoadPlanner(state),
             process_group=g.pg)
    return model
