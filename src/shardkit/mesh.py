"""Parallel layout of a job: degrees per axis, validated, turned into a named DeviceMesh.

shardkit keeps no module-level process groups. A job describes its layout once with
:class:`ParallelDims`, builds a ``torch.distributed.device_mesh.DeviceMesh`` from it, and passes
1-D submeshes (``mesh["tp"]``) explicitly to every layer and collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from dataclasses import dataclass, fields

from .errors import ShardkitError, ShardkitTypeError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims"]

# Outermost to innermost. tp is innermost so that its ranks are adjacent (same node, fastest
# links), the convention of Megatron-LM and torchtitan.
_AXES = ("dp", "pp", "cp", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis; their product must equal the world size.

    Args:
        dp: data-parallel degree.
        pp: pipeline-parallel degree.
        cp: context-parallel degree.
        tp: tensor-parallel degree.
        ep: expert-parallel degree.
        world_size: the number of ranks; defaults to the product of the degrees. When given
            (or when :meth:`build_mesh` runs inside an initialized process group) the product
            must match it.

    Raises:
        ShardkitTypeError: a degree is not an int.
        ShardkitError: a degree is < 1, or the degrees do not multiply to ``world_size``.

    Example:
        >>> dims = ParallelDims(dp=2, tp=2)
        >>> mesh = dims.build_mesh("cpu")          # inside a 4-rank world
        >>> tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    world_size: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "world_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ShardkitTypeError(f"ParallelDims: {f.name} must be an int, got {value!r}")
            if value < 1:
                raise ShardkitError(f"ParallelDims: {f.name} must be >= 1, got {value}")
        if self.world_size is not None and self.product != self.world_size:
            raise ShardkitError(
                f"ParallelDims: degrees {self.degrees} multiply to {self.product}, "
                f"but the world size is {self.world_size}"
            )

    @property
    def degrees(self) -> dict[str, int]:
        """Degree of every axis, outermost first."""
        return {axis: getattr(self, axis) for axis in _AXES}

    @property
    def product(self) -> int:
        return math.prod(self.degrees.values())

    def active_axes(self) -> list[str]:
        """Axes with degree > 1, outermost first."""
        return [axis for axis, d in self.degrees.items() if d > 1]

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Build the named ``DeviceMesh`` with every axis as a dimension (size-1 axes included).

        Must be called collectively by every rank of the default process group.

        Raises:
            ShardkitError: the process group is not initialized, or its size is not the product.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise ShardkitError("ParallelDims.build_mesh: torch.distributed is not initialized")
        world = dist.get_world_size()
        if self.product != world:
            raise ShardkitError(
                f"ParallelDims.build_mesh: degrees {self.degrees} multiply to {self.product}, "
                f"but the world size is {world}"
            )
        return init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=_AXES)
