"""Full (unsharded) parameters of a parallelized model, for checks and reports.

Collective over the world: FSDP2 shards are all-gathered over their data-parallel mesh, tensor-
and expert-parallel shards by their :class:`~shardkit.sharding.ShardSpec`, and with a
pipeline every stage's parameters travel to global rank 0: names, dtypes and shapes as JSON
(:func:`~shardkit.comm.agree.agree`), the bytes as one ``uint8`` message per stage leader. Nothing
is unpickled (``gather_object`` would unpickle what a peer sent).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..comm._compat import irecv, isend
from ..comm._group import GroupInfo, group_device, resolve_group
from ..comm.agree import agree
from ..errors import ShardkitError
from ..sharding import gather_full

if TYPE_CHECKING:
    from .decoder import ParallelModel

__all__ = ["gather_full_parameters"]

_OP = "gather_full_parameters"


def _stage_parameters(pm: ParallelModel) -> dict[str, torch.Tensor]:
    full = {}
    for name, p in pm.module.named_parameters():
        if pm.layouts[name].copy:
            continue
        t = p.detach()
        if hasattr(t, "full_tensor"):  # FSDP2 DTensor: collective over its dp mesh
            t = t.full_tensor()
        spec = pm.layouts[name].spec
        full[name] = t if spec is None else gather_full(t, spec)
    return full


def gather_full_parameters(pm: ParallelModel) -> dict[str, torch.Tensor] | None:
    """Every parameter of the whole model, full, on global rank 0; None on the other ranks.

    Args:
        pm: a :class:`~shardkit.parallelize.ParallelModel` (``pm.mesh`` None: this process's
            parameters are returned as they are).

    Returns:
        ``{name: tensor}`` with the unparallelized model's names (pipeline stages keep them).
    """
    if pm.mesh is None:
        return _stage_parameters(pm)
    mine = _stage_parameters(pm)
    if pm.stage is None:
        return mine if dist.get_rank() == 0 else None
    # One copy per stage: its leader on data-parallel rank 0 sends it.
    mesh = pm.mesh
    leader = mesh.local_rank("dp_cp") == 0 and mesh.local_rank("tp") == 0
    parts = _gather_to_first(mine if leader else {}, resolve_group(dist.group.WORLD, _OP))
    if parts is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return out


def _gather_to_first(part: dict[str, torch.Tensor], g: GroupInfo) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's ``{name: tensor}`` on group rank 0 (CPU tensors, rank order), None elsewhere.
    One agreement carries the names, dtypes and shapes; each rank with tensors then sends their
    bytes, concatenated, as one ``uint8`` message (on the group's device: NCCL moves device
    tensors only)."""
    meta = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in part.items()]
    seen = agree(g, _OP, None, meta, gather=True)
    device = group_device(g)
    if g.rank != 0:
        if part:
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in part.values()])
            isend(flat.to(device), g.pg, 0).wait()
        return None
    parts = [{name: t.detach().cpu() for name, t in part.items()}]
    for r in range(1, g.size):
        names, dtypes, shapes = [e[0] for e in seen[r]], [_dtype(e[1]) for e in seen[r]], [e[2] for e in seen[r]]
        sizes = [math.prod(shape) * dt.itemsize for dt, shape in zip(dtypes, shapes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        if names:
            irecv(flat, g.pg, r).wait()
        pieces = flat.cpu().split(sizes)
        # clone: each piece on its own storage, aligned for its dtype (offsets in flat need not be)
        parts.append({n: b.clone().view(dt).view(shape) for n, b, dt, shape in zip(names, pieces, dtypes, shapes)})
    return parts


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShardkitError(f"{_OP}: a peer described a parameter of unknown dtype {name!r}")
    return dtype
