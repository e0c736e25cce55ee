"""DCP chunk planners for tensors cut by a :class:`~shardkit.sharding.ShardSpec`: each tensor is
described to ``torch.distributed.checkpoint`` as chunks of its *full* tensor.

A spec lists arbitrary ranges per rank (balanced head splits, packed ``[G_r | U_r]`` parts, KV
heads held by several ranks), which DTensor's ``Shard(dim)`` (``torch.chunk`` blocks) cannot
describe. So:

* save (:class:`ChunkSavePlanner`): every rank writes the pieces of the full tensor it *owns*
  (for each full index, the first rank holding it, as in :func:`~shardkit.sharding.gather_full`),
  one DCP chunk per piece with its global offsets. The owned pieces of all ranks tile the full
  tensor exactly, which DCP's global-plan check verifies. Replicated tensors (and the identical
  pieces of other dp replicas) are written once: DCP's save-plan deduplication keeps one copy of
  each ``(key, offsets)``.
* load (:class:`ChunkLoadPlanner`): every rank asks for each of its local ranges (all of them,
  replicated heads included); DCP's ``create_read_items_for_chunk_list`` intersects them with the
  saved chunks, whatever layout wrote them, and reads straight into views of the local tensor.
* a tensor that is itself a block of the spec's local tensor (an FSDP2 shard: ``Shard(0)`` of
  the tensor-parallel local tensor over ``dp_shard``, :mod:`.fsdp_shards`) carries a
  :class:`Window` too: where it lies in that local tensor. Its chunks are the spec's ranges cut
  to the window, at the window's offsets on the other dims: still rectangular chunks of the full
  tensor, so FSDP2 shards are saved and loaded as they are, never all-gathered. Replicas of a
  window (HSDP's ``dp_replicate``) write the same ``(key, offsets)`` and DCP keeps one; an empty
  window (a trailing rank of an uneven FSDP2 split) writes and reads nothing.

Used by :mod:`.dcp` (tensor-parallel models) and :mod:`.train_state` (training checkpoints).

Source: PyTorch Distributed Checkpoint's planner interface (``SavePlanner`` / ``LoadPlanner``,
chunk metadata and resharding reads), as torchtitan and FSDP2 use it for DTensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
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
from ..sharding import ShardSpec, shard_spec

__all__ = ["ChunkSavePlanner", "ChunkLoadPlanner", "Window", "owned_ranges", "full_shape", "window", "set_window"]

# (global offsets, local view) of one chunk
_Chunk = tuple[tuple[int, ...], torch.Tensor]

_WINDOW_ATTR = "_shardkit_window"


@dataclass(frozen=True)
class Window:
    """Where a tensor lies inside the local tensor its :class:`~shardkit.sharding.ShardSpec`
    cuts (or inside the full tensor, without a spec): the block ``[offsets, offsets + shape of
    the tensor)`` of a tensor of shape ``shape``.

    Attributes:
        shape: the enclosing tensor's shape (the tensor-parallel local tensor's).
        offsets: the tensor's first element in it, one per dim.
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def window(t: torch.Tensor) -> Window | None:
    """The :class:`Window` recorded on ``t`` by :func:`set_window`, or None (``t`` is whole)."""
    return getattr(t, _WINDOW_ATTR, None)


def set_window(t: torch.Tensor, where: Window | None) -> torch.Tensor:
    """Record ``where`` on ``t`` (read back by :func:`window`) and return ``t``; None records nothing."""
    if where is not None:
        setattr(t, _WINDOW_ATTR, where)
    return t


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


def full_shape(t: torch.Tensor) -> torch.Size:
    """The full tensor's shape of local tensor ``t``: its window's enclosing shape (or its own),
    with the ShardSpec's dim at the spec's full size."""
    spec, where = shard_spec(t), window(t)
    shape = list(t.shape if where is None else where.shape)
    if spec is not None:
        shape[spec.dim] = spec.full_size
    return torch.Size(shape)


def _chunks(t: torch.Tensor, owned: bool) -> list[_Chunk]:
    """The chunks of local tensor ``t`` to write (``owned``) or to read (all local ranges)."""
    spec, where = shard_spec(t), window(t)
    base = (0,) * t.dim() if where is None else where.offsets
    if where is not None and t.numel() == 0 and math.prod(where.shape) > 0:
        return []  # an empty FSDP2 shard: the other ranks' chunks tile the tensor
    if spec is None:
        return [(tuple(base), t.detach())]
    rank = resolve_group(spec.group, "checkpoint").rank
    if owned:
        ranges = owned_ranges(spec, rank)
    else:
        ranges, pos = [], 0
        for a, b in spec.ranges[rank]:
            ranges.append((a, b, pos))
            pos += b - a
    # the spec's local positions [pos, pos + b - a) that fall inside the window along its dim
    d = spec.dim
    lo0, hi0 = base[d], base[d] + t.shape[d]
    out = []
    for a, b, pos in ranges:
        lo, hi = max(pos, lo0), min(pos + b - a, hi0)
        if hi > lo:
            offsets = list(base)
            offsets[d] = a + lo - pos
            out.append((tuple(offsets), t.detach().narrow(d, lo - lo0, hi - lo)))
    return out


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes each tensor as the chunks this rank owns, at their global offsets."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._state = state
        self._lookup: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # plan what DCP was handed: for a background save, the staged CPU copy
        # (checkpoint/background.py), never the live tensors training goes on changing
        self._state = state_dict

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, t in self._state.items():
            props = TensorProperties.create_from_tensor(t)
            # SHARD: one of several chunks of fqn (DCP merges them); TENSOR: the whole tensor
            whole = shard_spec(t) is None and window(t) is None
            kind = WriteItemType.TENSOR if whole else WriteItemType.SHARD
            for offsets, piece in _chunks(t, owned=True):
                self._lookup[(fqn, offsets)] = piece
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=kind,
                        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=full_shape(t)),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None  # every item this planner wrote has its chunk offset
        return self._lookup[(index.fqn, tuple(index.offset))]


class ChunkLoadPlanner(DefaultLoadPlanner):
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
            assert isinstance(saved, TensorStorageMetadata)  # the caller checked each key first (check_contents)
            requests += create_read_items_for_chunk_list(fqn, saved, local)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        assert index.index is not None  # read items carry the chunk's index
        return self._targets[index.fqn][index.index][1]

    def load_bytes(self, read_item, value) -> None:
        # DCP's default unpickles bytes items (torch.load(weights_only=False)); shardkit writes none
        raise ShardkitError(f"checkpoint: {read_item.dest_index.fqn!r} is a pickled item; shardkit never loads one")
