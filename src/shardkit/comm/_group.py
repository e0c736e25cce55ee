"""Normalize the ``group`` argument of every primitive, once, at the API boundary."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import GroupMembershipError, ShardkitError, ShardkitTypeError

__all__ = ["GroupInfo", "group_device", "resolve_group"]


@dataclass(frozen=True)
class GroupInfo:
    """A process group with this rank's group-relative rank and the group size, read once."""

    pg: dist.ProcessGroup
    size: int
    rank: int


# id(pg) -> (weak reference to pg, size, rank): a ProcessGroup's rank and size never change, so
# the checks below run once per group. The weak reference says whether the id still names that
# group (its callback drops the entry when the group is freed, before the id can be reused);
# nothing here holds the group itself, so a destroyed group is freed as before
# (tests/comm/test_host_path.py checks both). Module-level on purpose, the one cache of its kind:
# a ProcessGroup is a C++ object shardkit should not add attributes to, its entries are facts
# that never change for the life of the group, and a stale id can never hit (the callback).
_resolved: dict[int, tuple[weakref.ref, int, int]] = {}


def resolve_group(group, op: str) -> GroupInfo:
    """Accept a ``ProcessGroup`` or a 1-D ``DeviceMesh``; return :class:`GroupInfo`.

    There is deliberately no ``None -> WORLD`` fallback: the mesh is always an argument.

    Raises:
        ShardkitTypeError: ``group`` is None, a multi-dimensional mesh, or not a group.
        GroupMembershipError: this rank is not a member of ``group``.
        ShardkitError: torch.distributed is not initialized.
    """
    hit = _resolved.get(id(group))
    if hit is not None and (pg := hit[0]()) is group and dist.is_initialized():
        return GroupInfo(pg, hit[1], hit[2])
    if group is None:
        raise ShardkitTypeError(
            f"{op}: group is required (a ProcessGroup or a 1-D DeviceMesh); shardkit has no default group"
        )
    if not dist.is_initialized():
        raise ShardkitError(f"{op}: torch.distributed is not initialized")
    # new_group() hands non-members a sentinel instead of a ProcessGroup.
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise GroupMembershipError(
            f"{op}: global rank {dist.get_rank()} is not a member of the group it passed "
            "(dist.new_group returned NON_GROUP_MEMBER on this rank)"
        )
    if hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):  # DeviceMesh
        if group.ndim != 1:
            raise ShardkitTypeError(
                f"{op}: expected a 1-D DeviceMesh, got a {group.ndim}-D mesh with dims {group.mesh_dim_names}; "
                "pass a submesh such as mesh['tp']"
            )
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise ShardkitTypeError(f"{op}: group must be a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
    # The ProcessGroup's own rank()/size() (group-relative) rather than dist.get_rank(group):
    # the latter's Python checks cost ~30 us per call, a third of a small P2P message here.
    rank = group.rank()
    if rank < 0:
        raise GroupMembershipError(f"{op}: global rank {dist.get_rank()} is not a member of the group it passed")
    info = GroupInfo(pg=group, size=group.size(), rank=rank)
    key = id(group)

    def forget(_: weakref.ref, key: int = key) -> None:
        _resolved.pop(key, None)

    _resolved[key] = (weakref.ref(group, forget), info.size, rank)
    return info


def group_device(g: GroupInfo) -> torch.device:
    """Where the group's metadata tensors live when no input tensor says: CPU for gloo, else
    the current accelerator (one rule with the P2P receive buffers). A build with accelerator
    support on a machine without one (torch's CUDA wheels on CPU) has none available: CPU."""
    current = torch.accelerator.current_accelerator(check_available=True)
    if g.pg.name().lower() == "gloo" or current is None:
        return torch.device("cpu")
    return torch.device(current.type, torch.accelerator.current_device_index())
