"""The process groups of a layout: the only place that creates them (:meth:`ParallelDims.build_mesh
<shardkit.sharding.ParallelDims.build_mesh>` calls :func:`build_groups`).

Only the axes of degree > 1 get process groups: a size-1 axis is the identity, and a gloo group
keeps threads of its own (a long-lived process that builds many layouts, like a test world,
would otherwise pile up thousands of idle groups). Every subgroup gets the world's timeout (a
subgroup created with torch's default would wait 30 minutes in a disagreement instead of failing
as fast as the world does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm._compat import world_timeout_options
from .axes import EP_BORROW, FLAT_VIEWS
from .stage_groups import new_stage_groups

__all__ = ["build_groups"]


def build_groups(
    degrees: Mapping[str, int], ep: int, pp_tp: tuple[int, ...] | None, device_type: str
) -> tuple[DeviceMesh | None, dict[str, Any]]:
    """Collective over the default process group: the root mesh and the named views of a layout.

    Args:
        degrees: the degree of every axis of :data:`~shardkit.sharding.AXES` (their product is
            the world size; the caller checked it).
        ep: expert-parallel ranks, borrowed from ``dp_shard x cp_ring x cp_ulysses x tp``.
        pp_tp: a tp size per pipeline stage, or None.
        device_type: the meshes' device type.

    Returns:
        ``(root, views)``: the root ``DeviceMesh`` over the axes of degree > 1 (None when there
        is none, or for ``pp_tp``) and the views by name (flattened views, ``ep`` / ``edp``,
        ``hsdp``; for ``pp_tp`` the stage groups ``"stages"``, ``"tp"`` and the replicas' group).
    """
    if pp_tp is not None:
        return None, _vtp_views(pp_tp, degrees["dp_replicate"])
    world = dist.get_world_size()
    options = world_timeout_options()
    active = [(axis, d) for axis, d in degrees.items() if d > 1]
    views: dict[str, Any] = {}
    root = None
    if active:
        names = tuple(a for a, _ in active)
        # options alone: the default backend with these options (torch reads it as (None, options))
        override: dict[int | str, Any] | None = None if options is None else dict.fromkeys(range(len(names)), options)
        root = init_device_mesh(
            device_type, tuple(d for _, d in active), mesh_dim_names=names, backend_override=override
        )
    for name, dims in FLAT_VIEWS.items():
        present = tuple(d for d in dims if degrees[d] > 1)
        if not present:
            continue
        assert root is not None  # an axis of degree > 1 made the root mesh
        if len(present) == 1:
            views[name] = root[present[0]]
        else:
            views[name] = root[present]._flatten(name, backend_override=options)
    pp, dp_replicate, dp_shard = degrees["pp"], degrees["dp_replicate"], degrees["dp_shard"]
    if ep > 1:
        # ep groups: blocks of ep consecutive ranks inside each dp_shard x cp x tp block
        # (innermost first: with ep <= tp they stay inside a tp group's node), or runs of whole
        # such blocks of consecutive dp replicas (dp_replicate is the next dim out); edp pairs
        # the ranks holding the same experts (across those blocks and dp replicas).
        edp = dp_replicate * math.prod(degrees[a] for a in EP_BORROW) // ep
        shape = [(n, d) for n, d in (("pp", pp), ("edp", edp), ("ep", ep)) if d > 1]
        expert = _mesh(device_type, world, shape, options)
        views["ep"] = expert["ep"]
        if edp > 1:
            views["edp"] = expert["edp"]
    if dp_shard > 1 and dp_replicate > 1:
        # HSDP needs the 2-D (dp_replicate, dp_shard_cp) mesh itself, not its flattened view.
        cp = degrees["cp_ring"] * degrees["cp_ulysses"]
        mp = degrees["spatial_h"] * degrees["spatial"] * degrees["tp"]
        shape = [
            (n, d)
            for n, d in (("pp", pp), ("dp_replicate", dp_replicate), ("dp_shard_cp", dp_shard * cp), ("mp", mp))
            if d > 1 or n in ("dp_replicate", "dp_shard_cp")
        ]
        views["hsdp"] = _mesh(device_type, world, shape, options)["dp_replicate", "dp_shard_cp"]
    return root, views


def _mesh(device_type: str, world: int, shape: list[tuple[str, int]], options: Any) -> DeviceMesh:
    """A ``DeviceMesh`` of the whole world with named dims ``shape`` (outermost first)."""
    ranks = torch.arange(world).reshape(*(d for _, d in shape))
    ov = None if options is None else tuple((None, options) for _ in shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(n for n, _ in shape), backend_override=ov)


def _vtp_views(pp_tp: tuple[int, ...], dp_replicate: int) -> dict[str, Any]:
    """``pp_tp`` layouts: the stage groups of :func:`~shardkit.sharding.new_stage_groups`
    (replica-major ranks: ``rank = d * sum(pp_tp) + offset_s + i``)."""
    stages, dp_group = new_stage_groups(pp_tp, dp_replicate)
    views: dict[str, Any] = {"stages": stages, "tp": stages.tp_group}
    for name in ("dp_replicate", "dp", "dp_cp"):
        views[name] = dp_group
    return views
