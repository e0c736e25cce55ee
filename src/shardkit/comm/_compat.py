"""The one compatibility shim for c10d names that moved between torch releases.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (FutureWarning) in
favour of ``all_gather_single`` / ``reduce_scatter_single``; GPU environments still run older
torch (2.11 seen) that only has the old names. Same semantics, so pick whichever exists.

Point-to-point: torch >= 2.7 addresses peers by group rank (``P2POp(..., group_peer=)``,
``isend(..., group_dst=)``); older releases take only the global rank. shardkit passes group
ranks everywhere and translates them here, once, with ``dist.get_global_rank`` where needed.

Timeouts: a subgroup gets the backend's default timeout (30 minutes for gloo), not the world's;
:func:`world_timeout` reads the world's from its backend's private options, so that every group
of a run can be given it.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single",
    "reduce_scatter_single",
    "isend",
    "irecv",
    "p2p_op",
    "world_timeout",
    "world_timeout_options",
]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_GROUP_PEER = "group_peer" in inspect.signature(dist.P2POp.__init__).parameters
_GROUP_DST = "group_dst" in inspect.signature(dist.isend).parameters


def isend(tensor: torch.Tensor, pg: dist.ProcessGroup, group_dst: int):
    """``dist.isend`` to group rank ``group_dst`` of ``pg``."""
    if _GROUP_DST:
        return dist.isend(tensor, group=pg, group_dst=group_dst)
    return dist.isend(tensor, dst=dist.get_global_rank(pg, group_dst), group=pg)


def irecv(tensor: torch.Tensor, pg: dist.ProcessGroup, group_src: int):
    """``dist.irecv`` from group rank ``group_src`` of ``pg``."""
    if _GROUP_DST:
        return dist.irecv(tensor, group=pg, group_src=group_src)
    return dist.irecv(tensor, src=dist.get_global_rank(pg, group_src), group=pg)


def p2p_op(send: bool, tensor: torch.Tensor, pg: dist.ProcessGroup, group_peer: int) -> dist.P2POp:
    """A ``dist.P2POp`` (for ``batch_isend_irecv``) with group rank ``group_peer`` of ``pg``."""
    op = dist.isend if send else dist.irecv
    if _GROUP_PEER:
        return dist.P2POp(op, tensor, group=pg, group_peer=group_peer)
    return dist.P2POp(op, tensor, peer=dist.get_global_rank(pg, group_peer), group=pg)


def world_timeout():
    """The default process group's timeout (a ``timedelta``), which every group of a run shares
    (torch's subgroups otherwise get the backend's default, 30 minutes for gloo, whatever the
    world was created with); None when the backend's options cannot be read."""
    world = dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(world) == "nccl" else "cpu")
    try:
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None  # a backend without readable options: keep torch's default


def world_timeout_options():
    """Backend options carrying :func:`world_timeout`, for every subgroup a mesh creates; None
    when it cannot be read (torch's default then applies)."""
    from torch._C._distributed_c10d import Backend

    timeout = world_timeout()
    if timeout is None:
        return None
    backend = dist.get_backend(dist.group.WORLD)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    else:
        options = Backend.Options(backend, timeout)
    return options
