"""The one gradient-reduction path of a composed layout, and the global gradient norm.

Two conventions, chosen by ``grad_reduce`` (the ranks holding different data are
``dp_replicate x dp_shard x cp_ring x cp_ulysses``, ``D`` of them: the ``dp_cp`` group):

* ``"mean"`` (torch DDP's and FSDP2's): every rank back-propagates its own loss, e.g. the
  mean over its tokens (Hugging Face's ``labels=`` loss), and the reduced gradient is the
  **mean** over the ``D`` data ranks of the per-rank gradients. That is the gradient of the
  global token mean exactly when every data rank counts the same number of tokens (equal rows,
  no ``-100`` labels, or cp ranks each holding the same number of targeted tokens); otherwise
  back-propagate :func:`~shardkit.data_parallel.global_mean_loss`.
* ``"sum"`` (the trainer's): every rank back-propagates ``sum(its token losses) / N`` with ``N``
  the *global* target count, and the reduced gradient is the **sum** over the data ranks.

Tensor-parallel ranks hold the same data: their reductions are inside the model (Megatron's
f/g, and :func:`~shardkit.tensor_parallel.sum_grad_over` for replicated weights used on local
data). Expert weights are held by the ``ep`` ranks and replicated over ``edp``: their gradients
are summed over ``edp`` instead (and, for ``"mean"``, divided by the same ``D``); with FSDP2
(``dp_shard > 1``) the expert weights are sharded over ``edp`` and FSDP2 reduce-scatters them there.

:class:`GradientSync` does, after the last backward of a step (Megatron-LM's
``finalize_model_grads``): one bucketed all-reduce (sum) per dtype over ``dp_cp`` of every dense
gradient FSDP2 does not reduce itself, and one over ``edp`` of the expert gradients, then for
``"mean"`` one division by ``D`` (FSDP2 divides the gradients it reduces itself, by its
``set_gradient_divide_factor``). A step with gradient accumulation or a pipeline schedule reduces
once, after all its microbatches.

:meth:`GradientSync.clip_` computes the global 2-norm of the reduced gradient with every
parameter element counted once, however it is laid out: sharded over tp or ep (each rank its own
elements; replicated KV heads once), FSDP-sharded (each shard once; expert weights: each ``edp``
shard of each ``ep`` block once), replicated (only rank 0 of
each replica group counts), split over pipeline stages (each stage its own), then one all-reduce
over the world. It is the norm of the gradient each mode produces, so clipping acts on it alike.

Source: Megatron-LM ``finalize_model_grads`` / ``clip_grad_norm_fp32`` (norm over model-parallel
ranks with duplicates counted once); torchtitan's FSDP2 + TP gradient clipping; torch DDP's
gradient averaging (Li et al., VLDB 2020).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..comm import _c10d
from ..comm._group import GroupInfo, resolve_group
from ..errors import ShardkitError
from ..sharding import ShardSpec

if TYPE_CHECKING:
    from ..sharding import ParallelMesh

__all__ = ["GradReduce", "GradientSync", "ParamLayout", "check_grad_reduce"]

GradReduce = Literal["mean", "sum"]


def check_grad_reduce(grad_reduce: object, op: str) -> GradReduce:
    """``grad_reduce`` if it is ``"mean"`` or ``"sum"``; else a :class:`ShardkitError` naming ``op``."""
    if grad_reduce == "mean" or grad_reduce == "sum":
        return grad_reduce
    raise ShardkitError(f"{op}: grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")


@dataclass
class ParamLayout:
    """How one parameter is laid out over the mesh (recorded before FSDP2 replaces parameters).

    Attributes:
        name: qualified name in the model.
        expert: an expert weight (sharded over ``ep``, replicated over ``edp`` unless ``fsdp``).
        fsdp: FSDP2 shards it (over ``dp_shard_cp``, an expert weight over ``edp``) and reduces its
            gradient itself.
        spec: its tensor- or expert-parallel :class:`~shardkit.sharding.ShardSpec`, or None.
        copy: a second copy of another parameter of the model (a tied ``lm_head`` on the last
            pipeline stage, the embedding being on the first): left out of the norm and the
            full parameters.
    """

    name: str
    expert: bool
    fsdp: bool
    spec: ShardSpec | None
    copy: bool = False


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2 gradients), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _owned_mask(spec: ShardSpec, rank: int, local: torch.Tensor) -> torch.Tensor | None:
    """1 where this rank's local element along ``spec.dim`` is the first copy of its full index
    (in rank order, then local order), 0 for the other copies: key/value heads shared by several
    tp ranks, or repeated inside one rank for uneven GQA, count once. None when nothing repeats."""
    if not spec.overlapping:
        return None
    first: dict[int, tuple[int, int]] = {}
    for r in range(len(spec.ranges)):
        for pos, i in enumerate(spec.indices(r)):
            first.setdefault(i, (r, pos))
    mine = spec.indices(rank)
    keep = torch.tensor([first[i] == (rank, pos) for pos, i in enumerate(mine)], dtype=local.dtype, device=local.device)
    shape = [1] * local.dim()
    shape[spec.dim] = -1
    return keep.view(shape)


class GradientSync:
    """Reduce the gradients of one (stage) model and clip them by the global norm.

    Args:
        model: the parallelized module (after tensor, context, expert and data parallelism).
        mesh: its :class:`~shardkit.sharding.ParallelMesh`, or None for one process (then
            :meth:`reduce` does nothing and the norm is the local one).
        layouts: ``{name: ParamLayout}`` for every parameter of ``model``.
        pre_reduce: a callable run at the start of :meth:`reduce` (the tied-embedding sum
            between the first and last pipeline stage).
        grad_reduce: ``"mean"`` (torch DDP's: the mean over the ``D`` data ranks) or ``"sum"``
            (for losses already divided by the global token count); see the module docstring.
            It must match how FSDP2 was applied (:func:`~shardkit.data_parallel.apply_fsdp`'s
            ``grad_reduce``): FSDP2 reduces its own parameters.

    Raises:
        ShardkitError: a parameter has no layout; ``grad_reduce`` not ``"mean"`` or ``"sum"``.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: ParallelMesh | None,
        layouts: dict[str, ParamLayout],
        pre_reduce: Callable[[], None] | None = None,
        *,
        grad_reduce: GradReduce = "mean",
    ) -> None:
        """See the class docstring."""
        self.model, self.mesh, self.pre_reduce = model, mesh, pre_reduce
        self.grad_reduce = check_grad_reduce(grad_reduce, "GradientSync")
        # "mean" divides every gradient it reduces by the number of data ranks (DDP's average)
        self.divisor = mesh.size("dp_cp") if mesh is not None and self.grad_reduce == "mean" else 1
        self.params = [(p, layouts[name]) for name, p in model.named_parameters() if p.requires_grad]
        missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in layouts]
        if missing:
            raise ShardkitError(f"GradientSync: no layout recorded for {missing[:5]}")
        self._masks: dict[tuple[int, torch.dtype, torch.device], torch.Tensor | None] = {}  # per parameter
        self._dense: GroupInfo | None = None
        self._expert: GroupInfo | None = None
        if mesh is not None:
            self._dense = resolve_group(mesh["dp_cp"], "GradientSync") if mesh.size("dp_cp") > 1 else None
            self._expert = resolve_group(mesh["edp"], "GradientSync") if mesh.size("edp") > 1 else None

    def reduce(self) -> None:
        """Sum the gradients FSDP2 does not reduce over the ranks holding different data; for
        ``"mean"``, divide them by the number of data ranks ``D``.

        Collective over ``dp_cp`` (dense) and ``edp`` (experts). A parameter without a gradient
        gets zeros first, so every rank reduces the same buckets. ``pre_reduce`` (given at
        construction: the tied-embedding sum between the first and last pipeline stage) runs first.
        """
        if self.pre_reduce is not None:
            self.pre_reduce()
        for group, expert in ((self._dense, False), (self._expert, True)):
            if group is None and self.divisor == 1:
                continue
            params = [p for p, lay in self.params if lay.expert == expert and not lay.fsdp]
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            for dtype in sorted({g.dtype for g in grads}, key=str):
                same = [g for g in grads if g.dtype == dtype]
                flat = torch.cat([g.reshape(-1) for g in same])
                if group is not None:
                    flat = _c10d.all_reduce(flat, group, "expert_grads" if expert else "dp_cp_grads", "backward")
                if self.divisor != 1:
                    flat = flat / self.divisor
                for g, part in zip(same, flat.split([g.numel() for g in same])):
                    g.copy_(part.view_as(g))

    def _counts_here(self, lay: ParamLayout) -> bool:
        """Whether this rank counts the parameter's (local) elements in the norm."""
        if lay.copy:
            return False
        if self.mesh is None:
            return True
        if lay.expert:  # FSDP2 over edp: every rank holds its own shard of its ep block
            return lay.fsdp or self.mesh.local_rank("edp") == 0
        replicas = ["dp_replicate" if lay.fsdp else "dp_cp", "spatial_h", "spatial"]
        if lay.spec is None:
            replicas.append("tp")
        return all(self.mesh.local_rank(name) == 0 for name in replicas)

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (float64, 0-d), the same on every rank.

        Collective over the world (one all-reduce of one number). Call after :meth:`reduce`.
        """
        device = next((p.device for p, _ in self.params), torch.device("cpu"))
        total = torch.zeros((), dtype=torch.float64, device=device)
        for p, lay in self.params:
            if p.grad is None or not self._counts_here(lay):
                continue
            g = _local(p.grad).double()
            if lay.spec is not None and not lay.fsdp:
                key = (id(p), g.dtype, g.device)  # built once (on the device), not once per step
                if key not in self._masks:
                    self._masks[key] = _owned_mask(lay.spec, resolve_group(lay.spec.group, "GradientSync").rank, g)
                mask = self._masks[key]
                if mask is not None:
                    g = g * mask
            total += g.pow(2).sum()
        return self._world_sum(total)

    def _world_sum(self, total: torch.Tensor) -> torch.Tensor:
        """The square root of ``total`` (this rank's sum of squares) summed over the world."""
        if self.mesh is not None and dist.get_world_size() > 1:
            world = resolve_group(dist.group.WORLD, "GradientSync")
            total = _c10d.all_reduce(total.reshape(1), world, "grad_norm", "optimizer").reshape(())
        return total.sqrt()

    def clip_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (torch's rule); return the
        norm as a 0-d float64 tensor on the gradients' device, not read by the host (the trainer
        reads it with the loss, once per step).

        ``max_norm=None`` only measures. Collective over the world.
        """
        norm = self.global_norm()
        if max_norm is not None:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p, _ in self.params:
                if p.grad is not None:
                    _local(p.grad).mul_(scale.to(p.grad.dtype))
        return norm

    def clip_(self, max_norm: float | None) -> float:
        """:meth:`clip_norm_`, the norm read as a float (one device-to-host read)."""
        return self.clip_norm_(max_norm).item()
