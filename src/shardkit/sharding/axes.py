"""Mesh axes and flattened views of a parallel layout (names only: no process group here).

Axes, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp_ring``, ``cp_ulysses``,
``spatial_h``, ``spatial``, ``tp`` (tp innermost, so tp peers are adjacent ranks: same node, fastest links;
the order of torchtitan's ``ParallelDims`` and Megatron-LM). Their product is the world size.
Expert parallelism does not multiply the world: ``ep`` ranks are *borrowed* from
``dp_shard x cp_ring x cp_ulysses x tp`` (experts are then not tensor-parallel), as
torchtitan's ``ParallelDims`` and Megatron-LM's expert-data-parallel groups do, and past those
from whole blocks of several ``dp_replicate`` replicas (DeepSeek-V3's EP 64 spans its
data-parallel ranks; the ep group is then a run of consecutive replicas' blocks). The ranks
holding the same experts form the expert data-parallel group (``edp``), over which expert
gradients are reduced instead of ``dp_cp``.

Flattened views on the mesh (built once, for the gradient reductions and the loss):

===============  ===================================================  ====================
view             dims                                                 used for
===============  ===================================================  ====================
``dp``           ``dp_replicate x dp_shard``                          batch rows
``cp``           ``cp_ring x cp_ulysses``                             sequence shards
``dp_cp``        ``dp_replicate x dp_shard x cp_ring x cp_ulysses``   dense gradients, loss
``dp_shard_cp``  ``dp_shard x cp_ring x cp_ulysses``                  FSDP2 sharding
===============  ===================================================  ====================
"""

from types import MappingProxyType

__all__ = ["AXES", "FLAT_VIEWS", "EP_BORROW"]

AXES = ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "spatial_h", "spatial", "tp")
FLAT_VIEWS = MappingProxyType(
    {
        "dp": ("dp_replicate", "dp_shard"),
        "cp": ("cp_ring", "cp_ulysses"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp_ring", "cp_ulysses"),
        "dp_shard_cp": ("dp_shard", "cp_ring", "cp_ulysses"),
    }
)
# Dims whose ranks expert parallelism may borrow, outermost first (contiguous in AXES but for
# the spatial dims, which must be 1 with ep > 1).
EP_BORROW = ("dp_shard", "cp_ring", "cp_ulysses", "tp")
