"""ZeRO-1 and ZeRO-2: optimizer state (and gradients) sharded over the data ranks, parameters replicated.

The parameters stay whole on every data rank (forward and backward are unchanged); what is cut
into ``R`` equal parts is the optimizer's work:

* **Flat buckets.** The trainable parameters of one reduction group and dtype (dense ones over
  ``dp_cp``: ``dp_replicate x cp``; expert weights over ``edp``) are moved into one flat buffer
  of ``N`` elements padded to ``R * ceil(N / R)`` (zeros), and each parameter becomes a view of
  it (Megatron-LM's parameter buffer). Rank ``r`` of the group owns the contiguous slice
  ``[r * N_r, (r + 1) * N_r)``, ``N_r = ceil(N / R)``; its optimizer holds a parameter that is a
  view of that slice, so AdamW's ``exp_avg`` / ``exp_avg_sq`` exist for ``1 / R`` of the elements.
* **Both stages** reduce-scatter the flat gradient (sum, as :class:`~.grads.GradientSync`) into
  this rank's slice: ``(R - 1) / R`` of the buffer on a ring, half an all-reduce's
  ``2 (R - 1) / R``, so reduce-scatter plus the parameters' all-gather cost what plain data
  parallelism's all-reduce does (Megatron-LM's distributed optimizer). Stage 1 used to all-reduce
  and keep its slice (1.5x the bytes); no rank ever read the rest. The model's full gradients are
  freed right after, so only the ``1 / R`` shard lives through clipping and the step.
* **Clipping** by the global 2-norm: each rank sums the squares of its slice, every element
  weighted 1 where this rank is the one that counts it (tp-replicated weights on tp rank 0 only,
  GQA's repeated key/value heads once, a tied ``lm_head`` copy never, spatial replicas on rank 0),
  then one all-reduce of one number over the world, as :meth:`GradientSync.global_norm`. The
  ``R`` slices are disjoint, so every element of every gradient is counted exactly once.
* **After the step** the updated slices are all-gathered (``zero_params``, phase ``optimizer``)
  into every rank's flat buffer, i.e. into the model's parameters.

AdamW is elementwise, so stepping a slice of the flattened parameters gives exactly the
elements of the whole step: ``--verify`` parity is exact up to float rounding of the reductions.

Not built (refused where asked for): ZeRO over FSDP2 ranks (``dp_shard > 1`` already shards
parameters, gradients and state: ZeRO-3). Stage 2 runs the same calls as stage 1: the
gradient is reduce-scattered after the last backward of the step, not bucket by bucket during
backward, so the full gradient still exists at the end of backward (its peak) and is freed before
the optimizer's step. Why not bucket by bucket: the trainer accumulates a step's ``M``
microbatches (gradient accumulation, every pipeline schedule) into ``.grad``, so a bucket's
gradient is final only after its last microbatch's backward; reducing it earlier costs one
reduce-scatter per microbatch (``M`` times the traffic, DeepSpeed's ZeRO-2 under accumulation),
and reducing it at its last backward leaves the full buffer alive through the other ``M - 1``
microbatches, where the peak is. Only ``M = 1`` without a pipeline would lower the peak.

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", sec. 5 (P_os, P_os+g); Megatron-LM's distributed optimizer (contiguous parameter and
gradient buffers, each data rank steps its range, then an all-gather of the parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm import _c10d
from ..comm._group import GroupInfo, resolve_group
from ..errors import ShardkitError
from .grads import GradientSync, GradReduce, ParamLayout, _owned_mask

if TYPE_CHECKING:
    from ..sharding import ParallelMesh

__all__ = ["ZERO_STAGES", "ZeroBucket", "ZeroSync", "check_zero_stage", "zero_shard_size"]

ZERO_STAGES = (0, 1, 2)  # 0: off (plain GradientSync)


def check_zero_stage(stage: object, op: str) -> int:
    """``stage`` if it is 0, 1 or 2; else a :class:`ShardkitError` naming ``op``."""
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ShardkitError(f"{op}: zero must be 0 (off), 1 (optimizer state) or 2 (and gradients), got {stage!r}")
    return int(stage)  # type: ignore[call-overload]


def zero_shard_size(numel: int, ranks: int) -> int:
    """Elements each of ``ranks`` owns of a flat bucket of ``numel``: ``ceil(numel / ranks)`` (pure)."""
    return -(-numel // ranks)


class ZeroBucket:
    """One flat buffer: the parameters of one reduction group and dtype, and this rank's slice.

    Attributes:
        name: ``"dp_cp"`` or ``"edp"``.
        params: the model's parameters in the bucket, in ``named_parameters`` order (now views
            of ``flat``).
        layouts: their :class:`~.grads.ParamLayout`.
        group: the reduction group (None: one rank).
        ranks: its size ``R``.
        rank: this rank's place in it.
        shard_size: ``N_r = ceil(N / R)`` elements per rank.
        flat: ``[R * N_r]`` the parameters, then zero padding.
        shard: ``flat[rank * N_r : (rank + 1) * N_r]`` as the optimizer's parameter (a view:
            stepping it steps the model).
        offsets: each parameter's first element in ``flat``.
    """

    def __init__(self, name: str, params: list[tuple[nn.Parameter, ParamLayout]], group: GroupInfo | None) -> None:
        """See the class docstring; moves the parameters into the flat buffer (their values kept)."""
        self.name, self.group = name, group
        self.params = [p for p, _ in params]
        self.layouts = [lay for _, lay in params]
        self.ranks, self.rank = (group.size, group.rank) if group is not None else (1, 0)
        numel = sum(p.numel() for p in self.params)
        self.shard_size = zero_shard_size(numel, self.ranks)
        first = self.params[0]
        self.flat = first.detach().new_zeros(self.shard_size * self.ranks)
        self.offsets: list[int] = []
        pos = 0
        with torch.no_grad():
            for p in self.params:
                self.offsets.append(pos)
                view = self.flat[pos : pos + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view  # the Parameter object (and its hooks, its shard spec) stays
                pos += p.numel()
        lo = self.rank * self.shard_size
        self.shard = nn.Parameter(self.flat[lo : lo + self.shard_size])  # shares the storage
        self._weight: torch.Tensor | None = None
        self._weight_done = False

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s elements of a bucket-shaped tensor ``flat``, in its shape."""
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def flat_grad(self) -> torch.Tensor:
        """The parameters' gradients in one padded flat tensor (zeros for a missing one)."""
        out = self.flat.new_zeros(self.flat.numel())
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.view(out, i).copy_(p.grad)
        return out

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a bucket-shaped tensor."""
        lo = self.rank * self.shard_size
        return flat[lo : lo + self.shard_size]


class ZeroSync(GradientSync):
    """:class:`~.grads.GradientSync` for ZeRO-1 / ZeRO-2: reduce into this rank's slice, clip, gather.

    Args:
        model: as :class:`~.grads.GradientSync`.
        mesh: as :class:`~.grads.GradientSync`.
        layouts: as :class:`~.grads.GradientSync`.
        pre_reduce: as :class:`~.grads.GradientSync`.
        grad_reduce: as :class:`~.grads.GradientSync`.
        stage: 1 (optimizer state sharded) or 2 (and gradients); both reduce-scatter (the
            module docstring says why stage 2 cannot lower the peak further here).

    The optimizer must be built over :attr:`shard_params` (:class:`.zero_optim.ZeroAdamW`), and
    :meth:`gather_params` run after each of its steps.

    Raises:
        ShardkitError: ``stage`` not 1 or 2; a parameter FSDP2 owns (``dp_shard > 1``: already
            ZeRO-3 there); a parameter without a layout.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: ParallelMesh | None,
        layouts: dict[str, ParamLayout],
        pre_reduce: Callable[[], None] | None = None,
        *,
        grad_reduce: GradReduce = "mean",
        stage: int = 1,
    ) -> None:
        """See the class docstring."""
        super().__init__(model, mesh, layouts, pre_reduce, grad_reduce=grad_reduce)
        if check_zero_stage(stage, "ZeroSync") == 0:
            raise ShardkitError("ZeroSync: stage must be 1 or 2 (0 is the plain GradientSync)")
        self.stage = stage
        owned = [lay.name for _, lay in self.params if lay.fsdp]
        if owned:
            raise ShardkitError(
                f"ZeroSync: FSDP2 owns {owned[:3]} (dp_shard > 1 shards parameters, gradients and optimizer "
                "state already, ZeRO-3); use ZeRO over dp_replicate x cp with dp_shard 1"
            )
        self.buckets: list[ZeroBucket] = []
        for name, group, expert in (("dp_cp", self._dense, False), ("edp", self._expert, True)):
            mine = [(p, lay) for p, lay in self.params if lay.expert == expert]
            for dtype in sorted({p.dtype for p, _ in mine}, key=str):
                self.buckets.append(ZeroBucket(name, [(p, lay) for p, lay in mine if p.dtype == dtype], group))

    @property
    def shard_params(self) -> list[nn.Parameter]:
        """The optimizer's parameters: this rank's slice of every bucket."""
        return [b.shard for b in self.buckets]

    def reduce(self) -> None:
        """Sum every bucket's gradient over its group into this rank's slice (a reduce-scatter,
        both stages), divide by ``D`` for ``"mean"``, and free the model's full gradients.

        Collective over ``dp_cp`` and ``edp`` (one call per bucket, even for a rank without
        gradients: zeros). ``pre_reduce`` (the tied-embedding sum between pipeline stages) first.
        """
        if self.pre_reduce is not None:
            self.pre_reduce()
        for b in self.buckets:
            flat = b.flat_grad()
            api = "expert_grads" if b.name == "edp" else "dp_cp_grads"
            if b.group is None:
                part = flat
            else:
                part = _c10d.reduce_scatter(flat, b.group, 0, [b.shard_size] * b.ranks, api, "backward")
            if self.divisor != 1:
                part = part / self.divisor
            b.shard.grad = part
            for p in b.params:
                p.grad = None  # only the 1 / R slice lives on (no rank ever holds more reduced)

    def _weight(self, b: ZeroBucket) -> torch.Tensor | None:
        """1 where this rank counts an element of its slice in the norm, else 0 (None: all 1).
        Built once, on first use (after the pipeline marks a tied copy)."""
        if b._weight_done:
            return b._weight
        full = torch.ones(b.flat.numel(), dtype=torch.float64, device=b.flat.device)
        for i, lay in enumerate(b.layouts):
            w = b.view(full, i)
            if not self._counts_here_zero(lay):
                w.zero_()
            elif lay.spec is not None:
                mask = _owned_mask(lay.spec, resolve_group(lay.spec.group, "ZeroSync").rank, w)
                if mask is not None:
                    w.mul_(mask)
        part = b.slice_of(full)
        b._weight = None if bool((part == 1).all()) else part.clone()
        b._weight_done = True
        return b._weight

    def _counts_here_zero(self, lay: ParamLayout) -> bool:
        """:meth:`_counts_here` with the data ranks left out: their slices are disjoint."""
        if lay.copy:
            return False
        if self.mesh is None or lay.expert:
            return True
        replicas = ["spatial_h", "spatial"] + (["tp"] if lay.spec is None else [])
        return all(self.mesh.local_rank(name) == 0 for name in replicas)

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (float64, 0-d), the same on every rank:
        each rank's slices, weighted by :meth:`_weight`, then one all-reduce over the world."""
        device = self.buckets[0].flat.device if self.buckets else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        for b in self.buckets:
            if b.shard.grad is None:
                continue
            sq = b.shard.grad.double().pow(2)
            w = self._weight(b)
            total += (sq * w).sum() if w is not None else sq.sum()
        return self._world_sum(total)

    def clip_norm_(self, max_norm: float | None) -> torch.Tensor:
        """:meth:`GradientSync.clip_norm_` on the slices (the only gradients left after :meth:`reduce`)."""
        norm = self.global_norm()
        if max_norm is not None:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for b in self.buckets:
                if b.shard.grad is not None:
                    b.shard.grad.mul_(scale.to(b.shard.grad.dtype))
        return norm

    def gather_params(self) -> None:
        """All-gather every bucket's updated slice into every rank's flat buffer (the model's
        parameters). Collective over ``dp_cp`` and ``edp``; nothing for a one-rank bucket."""
        for b in self.buckets:
            if b.group is None:
                continue
            full = _c10d.all_gather(b.shard.detach(), b.group, 0, [b.shard_size] * b.ranks, "zero_params", "optimizer")
            with torch.no_grad():
                b.flat.copy_(full)
