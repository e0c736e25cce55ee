"""DTensor at the boundary of a sharded op: placement checks, the local tensor in, a DTensor out.

A user holding ``torch.distributed.tensor.DTensor`` s calls the spatial layers and the attention
functions with them as they are. These helpers find the mesh dim that is the op's group, check
that the DTensor's placement there is the ``Shard(dim)`` the op shards (plain ``Shard``: a
contiguous ``torch.chunk`` split), take the local tensor without a copy (``to_local`` is a view
and differentiable: its backward hands the gradient back as a DTensor of the same placements)
and wrap the op's local result with ``DTensor.from_local(..., run_check=False)`` and the global
shape and stride given explicitly, so uneven shards need no collective.

Every check here is a pure function of DTensor metadata (mesh, placements, global shape), which
all ranks share, so a wrong input raises the same :class:`ShardkitError` on every rank before any
collective: no rank is left waiting.

Source: PyTorch DTensor's placement types (``Shard``, ``Replicate``, ``Partial``) and its
``torch.chunk`` rule for uneven shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._shapes import chunk_sizes
from ..errors import ShardkitError, ShardkitTypeError
from ._group import resolve_group

__all__ = ["any_dtensor", "from_local", "group_mesh_dim", "local_of", "same_kind", "shard_sizes", "check_placements"]


def any_dtensor(*tensors: object) -> bool:
    """True when any argument is a DTensor (the op then takes its DTensor path)."""
    return any(isinstance(t, DTensor) for t in tensors)


def same_kind(named: Mapping[str, object], op: str) -> tuple[DTensor, ...]:
    """Check that all of ``named`` are DTensors on one mesh with one set of placements.

    Raises:
        ShardkitTypeError: DTensors mixed with plain tensors (names both kinds).
        ShardkitError: two DTensors on different meshes or with different placements.
    """
    dts = [n for n, t in named.items() if isinstance(t, DTensor)]
    plain = [n for n in named if n not in dts]
    if plain:
        raise ShardkitTypeError(
            f"{op}: {', '.join(dts)} {'is a DTensor' if len(dts) == 1 else 'are DTensors'} but "
            f"{', '.join(plain)} {'is' if len(plain) == 1 else 'are'} not; pass all of "
            f"{', '.join(named)} as DTensors or all as local tensors"
        )
    first = named[dts[0]]
    assert isinstance(first, DTensor)
    for name in dts[1:]:
        t = named[name]
        assert isinstance(t, DTensor)
        if t.device_mesh != first.device_mesh or tuple(t.placements) != tuple(first.placements):
            raise ShardkitError(
                f"{op}: {name} is on mesh {t.device_mesh} with placements {tuple(t.placements)}, but {dts[0]} is on "
                f"mesh {first.device_mesh} with {tuple(first.placements)}; they must match"
            )
    return tuple(named[n] for n in dts)  # type: ignore[misc]


def _ranks(pg) -> list[int]:
    return list(dist.get_process_group_ranks(pg))


def group_mesh_dim(mesh: DeviceMesh, group, op: str) -> int:
    """The dim of ``mesh`` whose process group (at this rank) holds the ranks of ``group``.

    ``group`` is the op's ``ProcessGroup`` or 1-D ``DeviceMesh``.

    Raises:
        ShardkitError: no dim of ``mesh`` is that group (the DTensor lives on another mesh).
    """
    want = _ranks(resolve_group(group, op).pg)
    for i in range(mesh.ndim):
        if _ranks(mesh.get_group(i)) == want:
            return i
    raise ShardkitError(
        f"{op}: the DTensor's mesh {mesh} (dims {mesh.mesh_dim_names}) has no dim whose group is the op's group "
        f"(global ranks {want}); build the DTensor on the mesh whose dim the op runs over"
    )


def check_placements(dt: DTensor, wanted: Mapping[int, int], op: str, free: Sequence[int] = (0,)) -> list[int]:
    """Check ``dt``'s placements: ``Shard(wanted[i])`` on each mesh dim ``i`` of ``wanted``; on the
    other mesh dims ``Replicate`` or ``Shard(d)`` with ``d`` in ``free`` (dims the op treats
    independently, e.g. the batch dim), never ``Partial``.

    Returns:
        The tensor dims of ``wanted`` normalized to ``[0, ndim)``, in mesh-dim order.

    Raises:
        ShardkitError: a missing or wrong placement, naming the mesh dim, expected and actual.
    """
    nd = dt.ndim
    names = dt.device_mesh.mesh_dim_names or tuple(str(i) for i in range(dt.device_mesh.ndim))
    for i, p in enumerate(dt.placements):
        if i in wanted:
            d = wanted[i] % nd
            if type(p) is not Shard or p.dim % nd != d:
                raise ShardkitError(
                    f"{op}: the DTensor's placement on mesh dim {names[i]!r} (the op's group of "
                    f"{dt.device_mesh.size(i)}) must be Shard({d}), got {p}; redistribute it first"
                )
        elif not (isinstance(p, Replicate) or (type(p) is Shard and p.dim % nd in [f % nd for f in free])):
            allowed = " or ".join(["Replicate()"] + [f"Shard({f % nd})" for f in free])
            raise ShardkitError(
                f"{op}: the DTensor's placement on mesh dim {names[i]!r} must be {allowed} (the op does not "
                f"reduce or gather over it), got {p}; redistribute it first"
            )
    return [wanted[i] % nd for i in sorted(wanted)]


def shard_sizes(dt: DTensor, mesh_dim: int) -> list[int]:
    """Every rank's size of ``dt`` along the tensor dim sharded over ``mesh_dim`` (torch.chunk rule).

    Only for a dim sharded over this one mesh dim (nested shards of one dim are not split here).
    """
    p = dt.placements[mesh_dim]
    assert isinstance(p, Shard)
    return chunk_sizes(dt.shape[p.dim], dt.device_mesh.size(mesh_dim))


def local_of(dt: DTensor) -> torch.Tensor:
    """The local tensor, without a copy (a view sharing storage) and with autograd through it."""
    return dt.to_local()


def from_local(local: torch.Tensor, like: DTensor, shape: Sequence[int]) -> DTensor:
    """``local`` as a DTensor on ``like``'s mesh and placements with global ``shape`` (contiguous
    stride), no collective (``run_check=False``); gradients flow back to ``local``."""
    stride, acc = [], 1
    for n in reversed(list(shape)):
        stride.append(acc)
        acc *= max(int(n), 1)
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(reversed(stride)),
    )
