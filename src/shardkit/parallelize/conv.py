"""``parallelize_conv``: spatial x dp on a convolutional model (the decoders' :func:`.parallelize`
counterpart).

1. **spatial**: :func:`~shardkit.spatial.apply_spatial` over the mesh's spatial dims of size > 1:
   one dim shards the frames along one tensor dim, two of them (``spatial_h`` and ``spatial``)
   tile them on the 2-D submesh. The converted layers sum parameter gradients over the spatial
   group in backward.
2. **dp**: every parameter stays replicated; one :class:`~shardkit.data_parallel.GradientSync`
   reduces the gradients over the data-parallel ranks (``dp_replicate x dp_shard``: the frames
   are small, so ``dp_shard`` ranks hold whole replicas too), their mean (``grad_reduce="mean"``,
   DDP's) or sum, and clips by the global norm.

Source: spatial (domain) parallelism of convolutions with halo exchange, as in Dryden et al.,
"Improving Strong-Scaling of CNN Training by Exploiting Finer-Grained Parallelism" (IPDPS 2019).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from ..data_parallel import GradientSync, GradReduce, ParamLayout
from ..data_parallel.grads import check_grad_reduce
from ..errors import ShardkitError
from ..spatial import apply_spatial
from .decoder import ParallelModel

if TYPE_CHECKING:
    from ..sharding import ParallelMesh

__all__ = ["parallelize_conv"]


def parallelize_conv(
    model: nn.Module,
    mesh: ParallelMesh | None,
    spatial_dims: Sequence[tuple[str, int]],
    *,
    grad_reduce: GradReduce = "mean",
) -> ParallelModel:
    """Shard ``model``'s frames over the mesh's spatial dims, replicate its parameters over dp, in place.

    Every rank calls it on a model with the same full weights. Afterwards the forward contract
    is the model's own on this rank's block: the batch rows of its dp coordinate, and along each
    sharded tensor dim its block of the balanced split (e.g. ``[B/dp, C, H, W/spatial]``).

    Args:
        model: a convolutional ``nn.Module`` :func:`~shardkit.spatial.apply_spatial` converts.
        mesh: the job's :class:`~shardkit.sharding.ParallelMesh` (spatial x dp only); None for one
            process (nothing is changed: the same trainer runs the ``--verify`` reference).
        spatial_dims: ``(mesh dim, tensor dim)`` pairs, e.g. ``(("spatial_h", 2), ("spatial", 3))``
            for NCHW frames; the mesh dims of size 1 are skipped.
        grad_reduce: ``"mean"`` (DDP's): the mean over the dp ranks of their gradients, for a
            loss that is each dp rank's own mean; ``"sum"``: their sum, for a loss already
            divided by the global element count. The spatial ranks of one frame are parts of
            one loss either way: each back-propagates its block's share, normalised by the
            element count of its dp rank's (``"mean"``) or the global (``"sum"``) batch.

    Returns:
        :class:`~shardkit.parallelize.ParallelModel` (no cp, no sequence or loss parallelism).

    Raises:
        ShardkitError: a mesh with tp, cp, pp or ep (a convolutional model has no heads,
            sequence or experts to shard), a mesh dim in ``spatial_dims`` that is not spatial,
            ``grad_reduce`` not ``"mean"`` or ``"sum"``;
            :func:`~shardkit.spatial.apply_spatial`'s errors (layers it cannot shard).
    """
    grad_reduce = check_grad_reduce(grad_reduce, "parallelize_conv")
    if mesh is not None:
        dims = mesh.dims
        others = {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "ep": dims.ep}
        if any(size > 1 for size in others.values()) or dims.pp_tp is not None:
            given = ", ".join(f"{k}={v}" for k, v in others.items() if v > 1) or f"pp_tp={dims.pp_tp}"
            raise ShardkitError(f"parallelize_conv: {given} on a convolutional model (it takes spatial x dp only)")
        bad = [name for name, _ in spatial_dims if name not in ("spatial_h", "spatial")]
        if bad:
            raise ShardkitError(f"parallelize_conv: spatial_dims names {bad}, expected 'spatial_h' and/or 'spatial'")
        sharded = [(name, dim) for name, dim in spatial_dims if mesh.size(name) > 1]
        if len(sharded) == 1:
            model = apply_spatial(model, mesh[sharded[0][0]], dim=sharded[0][1])
        elif sharded:
            names, tensor_dims = zip(*sharded)
            model = apply_spatial(model, mesh[names], dim=tensor_dims)
    layouts = {name: ParamLayout(name, False, False, None) for name, _ in model.named_parameters()}
    return ParallelModel(model, mesh, None, GradientSync(model, mesh, layouts, grad_reduce=grad_reduce), layouts)
