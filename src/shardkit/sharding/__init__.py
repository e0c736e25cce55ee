"""The sharding vocabulary every parallel wing shares: layouts, shard specs, the job's mesh.

* :mod:`.layouts`: :class:`Replicate`, :class:`Shard`, :class:`Partial`, the layout of a tensor
  over a group (tensor-parallel styles, pipeline stage boundaries).
* :mod:`.spec`: :class:`ShardSpec`, the index ranges of a parameter each rank holds, with
  :func:`cut`, :func:`gather_full` and :func:`shard_parameter` (tensor and expert parallelism,
  gradient norms, checkpoints).
* :mod:`.mesh`, :mod:`.axes`, :mod:`.groups`: :class:`ParallelDims` (the degree of every axis) and
  the :class:`ParallelMesh` it builds, the only place that creates a job's process groups.
* :mod:`.stage_groups`: :class:`StageGroups`, the groups of pipeline stages of different tp
  sizes (``ParallelDims(pp_tp=...)``).

This floor imports only :mod:`shardkit.comm` and the package's base modules: no parallel wing
imports another one for its vocabulary.
"""

from .axes import AXES, FLAT_VIEWS
from .layouts import Partial, Replicate, Shard, check_layout
from .mesh import ParallelDims, ParallelMesh
from .spec import ShardSpec, cut, gather_full, set_shard_spec, shard_parameter, shard_spec
from .stage_groups import StageGroups, new_stage_groups

__all__ = [
    "Replicate",
    "Shard",
    "Partial",
    "check_layout",
    "ShardSpec",
    "shard_spec",
    "set_shard_spec",
    "cut",
    "gather_full",
    "shard_parameter",
    "ParallelDims",
    "ParallelMesh",
    "AXES",
    "FLAT_VIEWS",
    "StageGroups",
    "new_stage_groups",
]
