"""An FSDP2 parameter's (or AdamW moment's) own shard, and where it lies in the
tensor-parallel local tensor: what a checkpoint saves instead of all-gathering it.

``fully_shard`` turns a parameter into a ``DTensor`` over the data-parallel mesh (``dp_shard x
cp``, or ``dp_replicate x dp_shard x cp`` for HSDP, ``edp`` for experts) whose global tensor is
the tensor-/expert-parallel local tensor (shardkit's tp and ep cut plain tensors, described by a
:class:`~shardkit.sharding.ShardSpec`; FSDP2 never sees them as DTensors). Its placements are
``Shard(0)`` (and ``Replicate()`` over ``dp_replicate``): rank ``k`` of ``dp_shard`` holds rows
``[sum(c[:k]), sum(c[:k]) + c[k])`` of dim 0, with ``c = chunk_sizes(rows, dp_shard)``
(``torch.chunk``'s rule, FSDP2's and DTensor's: trailing ranks may hold fewer rows or none;
FSDP2 pads its storage, but the DTensor's local tensor is the unpadded rows). That block is a
rectangle of the local tensor, so :mod:`.chunks` composes it with the ShardSpec into chunks of the
full tensor at computable offsets (a :class:`~.chunks.Window`).

Every placement is read from DTensor metadata all ranks share (mesh, placements, global shape),
so each rank takes the same path: no rank is left waiting in a gather another rank skipped.
Placements other than ``Shard`` and ``Replicate`` (``Partial``; a strided shard of a tensor that
was a DTensor before FSDP2) keep the previous path: the DTensor is all-gathered
(``full_tensor``) and, on load, the loaded tensor is cut back locally (no collective).

Source: PyTorch FSDP2's per-parameter ``Shard(0)`` sharding (``torch.chunk`` split, padded
storage) and DTensor's nested ``Shard`` placements; DCP saves FSDP2 state the same way, each
rank its shard (torchtitan's checkpointer).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .._shapes import chunk_sizes
from ..errors import ShardkitError
from .chunks import Window

__all__ = ["dtensor_window", "saved_local", "write_back"]


def dtensor_window(t: DTensor) -> Window | None:
    """Where this rank's local tensor of ``t`` lies in ``t``'s global tensor; None when a
    placement is neither ``Shard`` nor ``Replicate`` (the caller gathers instead).

    Nested ``Shard`` placements are applied in mesh-dim order (DTensor's rule), each a
    ``torch.chunk`` split of what the earlier ones left.

    Raises:
        ShardkitError: the local tensor's shape differs from the computed block (a DTensor
            sharded by another rule than ``torch.chunk``): a bug to report, never a silent
            wrong save.
    """
    mesh, placements = t.device_mesh, t.placements
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    coords = mesh.get_coordinate()
    if coords is None:  # this rank is outside the mesh: it holds nothing of t
        return None
    shape = tuple(t.shape)
    offsets, sizes = [0] * len(shape), list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            parts = chunk_sizes(sizes[d], mesh.size(i))
            offsets[d] += sum(parts[: coords[i]])
            sizes[d] = parts[coords[i]]
    local = t.to_local()
    if tuple(local.shape) != tuple(sizes):
        raise ShardkitError(
            f"checkpoint: a DTensor of global shape {shape} with placements {tuple(placements)} holds a "
            f"local tensor of shape {tuple(local.shape)} at mesh coordinate {coords}, not the torch.chunk "
            f"block {tuple(sizes)}"
        )
    return Window(shape, tuple(offsets))


def saved_local(t: torch.Tensor) -> tuple[torch.Tensor, Window | None, bool]:
    """What a checkpoint saves of parameter or moment ``t``, and reads into.

    Returns:
        ``(tensor, window, gathered)``: a plain tensor ``t`` itself (no window); an FSDP2
        DTensor's local shard (a view: a load reads straight into it) and its window; or, for
        other placements, the all-gathered global tensor (``gathered``: a load must copy it
        back, :func:`write_back`).
    """
    if not isinstance(t, DTensor):
        return t.detach(), None, False
    where = dtensor_window(t)
    if where is None:
        return t.full_tensor().detach(), None, True
    return t.to_local().detach(), where, False


def write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a loaded global tensor into DTensor ``dst``: each rank keeps its own block of it
    (``distribute_tensor`` without a source rank: a local cut, no collective)."""
    assert isinstance(dst, DTensor)  # only gathered DTensors are written back
    local = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
    with torch.no_grad():
        dst.to_local().copy_(local)
