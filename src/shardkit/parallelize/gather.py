"""Full (unsharded) parameters of a parallelized model, for checks and reports.

Collective over the world: FSDP2 shards are all-gathered over their data-parallel mesh, tensor-
and expert-parallel shards by their :class:`~shardkit.sharding.ShardSpec`, and with a
pipeline every stage's parameters travel to global rank 0 (one ``gather_object``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..sharding import gather_full

if TYPE_CHECKING:
    from .decoder import ParallelModel

__all__ = ["gather_full_parameters"]


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
    part = {name: t.cpu() for name, t in mine.items()} if leader else {}
    parts: list[dict[str, torch.Tensor] | None] | None = (
        [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    )
    dist.gather_object(part, parts, dst=0)
    if parts is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        out.update(p or {})
    return out
