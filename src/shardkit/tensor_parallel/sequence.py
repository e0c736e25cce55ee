"""The per-model layout state of tensor (and sequence) parallelism: :class:`SequenceSharding`.

Styles that move activations between layouts (:class:`~.styles.ColwiseParallel` with
``input_layouts=Shard(1)``, :class:`~.styles.RowwiseParallel` with ``output_layouts=Shard(1)``,
:class:`~.styles.PrepareModuleInput`) share one instance per parallelized model. It holds:

* the sequence split sizes of the current forward. The split (``Replicate -> Shard``) reads the
  full length ``S`` and fixes the balanced sizes (:func:`shardkit.balanced_split_sizes`, any
  ``S``, zero-size blocks included); every later gather of the same forward uses them. Backward
  never reads this object: each autograd Function keeps the sizes it ran with.
* the last prepared input, so sibling column-parallel layers that read the same tensor (q/k/v,
  gate/up) share one entry: one sequence all-gather (whose backward reduce-scatters the sum of
  their partial input gradients), or one Megatron ``f`` for a replicated input. A
  :class:`~.styles.PrepareModuleInput` on the parent module does the same explicitly; its output
  is recognized as prepared by the children's styles.

Sequence parallelism: Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), as implemented in Megatron-LM; the sharing of one ``f`` follows
Megatron-LM's fused qkv / gate-up projections.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from .._shapes import balanced_split_sizes
from ..comm import (
    all_gather,
    all_reduce_backward,
    gather_forward_split_backward,
    reduce_scatter,
    split_forward_gather_backward,
)
from ..comm._group import resolve_group
from ..comm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from ..comm.replay_scope import unreplayed
from ..errors import ShardkitError
from .sp_saved import Regather, RegatherPool, check_sp_activation

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["SequenceSharding"]


class _PartialGradOfReplicated(torch.autograd.Function):
    """Identity forward; backward keeps only this rank's sequence block of the gradient (zeros
    elsewhere). For a replicated consumer of a gathered tensor: its gradient is the same on every
    rank, and the gather's reduce-scatter sums over ranks, so each rank contributes its block.
    The tensor is ``[B, S, H]`` or its token-flattened view ``[B * S, H]``."""

    @staticmethod
    def forward(ctx, x, start, size, seq_len):
        ctx.start, ctx.size, ctx.seq_len = start, size, seq_len
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad.reshape(-1, ctx.seq_len, grad.shape[-1])
        out = torch.zeros_like(g)
        out[:, ctx.start : ctx.start + ctx.size] = g[:, ctx.start : ctx.start + ctx.size]
        return out.view_as(grad), None, None, None


class SequenceSharding:
    """Sequence split sizes of one model's current forward, and its shared prepared inputs.

    One instance per parallelized model (no globals); :func:`shardkit.apply_tp` makes it, or
    pass one to ``style.apply(module, group, seq=...)`` to share it between hand-applied styles.

    Args:
        group: the tp ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the default sequence dim of hidden states (1 for ``[B, S, H]``).
        activation: what the column-parallel readers of a sequence all-gather keep for backward:
            ``"gathered"`` (its ``[B, S, H]`` output) or ``"shard"`` (this rank's block, gathered
            again in backward: :mod:`.sp_saved`).
        async_tp: decompose each sequence all-gather into ring steps overlapping its
            column-parallel readers' matmuls (one ring for the readers registered with the
            gathering block: q/k/v, gate/up, the head), and each row-parallel reduce-scatter into
            ring steps overlapping the matmul producing it (:mod:`shardkit.comm.collective_matmul`).
            The same layer and layouts; only how the collective is issued changes.

    Raises:
        ShardkitError: an unknown ``activation``.
    """

    def __init__(self, group: Group, dim: int = 1, activation: str = "gathered", async_tp: bool = False) -> None:
        self.group = group
        self.dim = dim
        self.info = resolve_group(group, "SequenceSharding")
        self.activation = check_sp_activation(activation, "SequenceSharding")
        self.async_tp = bool(async_tp) and self.info.size > 1
        self.readers: dict[str, list[torch.nn.Linear]] = {}  # async_tp: gathering block -> its column-parallel readers
        self._async: tuple | None = None  # (gathered output, {id(reader): its output}) of the last async gather
        self.sizes: list[int] | None = None
        self._last: tuple | None = None  # (weakref(source), kind, prepared output, grad mode)
        self._shard: tuple | None = None  # ("shard" mode) (gathered output, its shard, Regather)
        self.pool = RegatherPool()

    # ----------------------------------------------------------------- sizes
    def set_sizes(self, sizes: Sequence[int]) -> None:
        """Declare the per-rank sequence sizes of inputs that arrive already sharded."""
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.info.size or any(s < 0 for s in sizes):
            raise ShardkitError(
                f"SequenceSharding.set_sizes: need {self.info.size} sizes >= 0 (one per tp rank), got {sizes}"
            )
        self.sizes = sizes

    def _gather_sizes(self, x: torch.Tensor, dim: int) -> list[int]:
        n = x.shape[dim]
        if self.sizes is None:
            return [n] * self.info.size  # an input that arrived sharded, none declared: equal blocks
        if self.sizes[self.info.rank] != n:
            raise ShardkitError(
                f"SequenceSharding.gather: rank {self.info.rank} of {self.info.size} holds {n} positions along dim "
                f"{dim}, but the split of this forward gave it {self.sizes[self.info.rank]} (sizes {self.sizes}); "
                "was the sequence split by another model's state?"
            )
        return self.sizes

    def _scatter_sizes(self, x: torch.Tensor, dim: int) -> list[int]:
        n = x.shape[dim]
        if self.sizes is not None and sum(self.sizes) == n:
            return self.sizes
        return balanced_split_sizes(n, self.info.size)

    # ------------------------------------------------------- layout changes
    def split(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """``Replicate -> Shard(dim)``: ``[B, S, H]`` -> ``[B, S_r, H]``; backward all-gathers.

        Fixes the sizes of this forward (balanced split of ``S``). The gathered gradient is the
        gradient of the replicated input on every rank, so what produced it (the embedding)
        gets an identical, complete gradient on every tp rank.
        """
        dim = self.dim if dim is None else dim
        self.sizes = balanced_split_sizes(x.shape[dim], self.info.size)
        return split_forward_gather_backward(x, self.group, dim, self.sizes)

    def gather(self, x: torch.Tensor, dim: int | None = None, block: str | None = None) -> torch.Tensor:
        """``Shard(dim) -> Replicate``: ``[B, S_r, H]`` -> ``[B, S, H]``; backward reduce-scatters
        the (partial) gradients. Shared: the same ``x`` again gives the same output.

        With ``async_tp``, ``block`` (the gathering module's name) names the column-parallel
        readers whose outputs the ring computes as the blocks arrive (:meth:`add_reader`); they
        take them with :meth:`async_output`."""
        dim = self.dim if dim is None else dim
        hit = self._hit(x, ("gather", dim))
        if hit is not None:
            return hit
        sizes = self._gather_sizes(x, dim)
        readers = self.readers.get(block or "") if self.async_tp else None
        if readers:
            ws = [m.weight for m in readers]
            bs = [m.bias for m in readers]
            full, ys = all_gather_matmul(x, self.info, dim, sizes, ws, bs, self.activation)
            self._async = (full, {id(m): y for m, y in zip(readers, ys)})
            return self._keep(x, ("gather", dim), full)
        if self.activation == "gathered" or not (x.requires_grad and torch.is_grad_enabled()):
            return self._keep(x, ("gather", dim), all_gather(x, self.group, dim, sizes))
        with unreplayed():  # a selective checkpoint must not keep the T x H output this layout drops
            out = all_gather(x, self.group, dim, sizes)
        handle = Regather(self.info, dim % x.dim(), sizes, self.pool)
        if torch._C._current_graph_task_id() != -1:  # a checkpoint's recompute, in backward
            handle.recomputed(x, out)
        self._shard = (out, x, handle)
        return self._keep(x, ("gather", dim), out)

    def add_reader(self, block: str, module: torch.nn.Linear) -> None:
        """``module`` (a column-parallel ``nn.Linear``) reads the input ``block`` gathers: with
        ``async_tp`` its matmul runs inside that gather's ring."""
        if self.async_tp:
            self.readers.setdefault(block, []).append(module)

    def async_output(self, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor | None:
        """The output the last async gather's ring computed for ``module`` reading ``x``, or None
        (``x`` is not that gather's output, or ``module`` is not one of its readers)."""
        if self._async is None or self._async[0] is not x:
            return None
        return self._async[1].pop(id(module), None)

    def linear_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """A row-parallel ``F.linear(x, weight)`` reduce-scattered along ``dim``: the ring of
        :func:`~shardkit.comm.collective_matmul.matmul_reduce_scatter` with ``async_tp``, else
        the matmul then :meth:`reduce_scatter`."""
        dim = self.dim if dim is None else dim
        if not self.async_tp:
            return self.reduce_scatter(torch.nn.functional.linear(x, weight), dim)
        return matmul_reduce_scatter(x, weight, self.info, dim, self._scatter_sizes(x, dim))

    def shard_of(self, x: torch.Tensor) -> tuple[torch.Tensor, Regather] | None:
        """``(shard, Regather)`` when ``x`` is the output of this forward's last sequence
        all-gather under ``activation="shard"`` (a column-parallel reader keeps the shard), else None."""
        if self._shard is None or self._shard[0] is not x:
            return None
        return self._shard[1], self._shard[2]

    def gather_replicated_grad(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """``Shard(dim) -> Replicate`` where the gradient downstream is replicated (the same on
        every rank, e.g. the logits of a loss computed on every rank): backward keeps this rank's
        block of it, no communication."""
        dim = self.dim if dim is None else dim
        return gather_forward_split_backward(x, self.group, dim, self._gather_sizes(x, dim))

    def reduce_scatter(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """Partial sums ``[B, S, H]`` -> summed block ``[B, S_r, H]``; backward all-gathers."""
        dim = self.dim if dim is None else dim
        return reduce_scatter(x, self.group, dim, self._scatter_sizes(x, dim))

    def replicate(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated input entering column-parallel layers: Megatron's ``f`` (identity forward,
        all-reduce of the partial gradients backward), shared by siblings reading the same ``x``.
        An input already prepared (a gather's output, an ``f``'s output) passes unchanged."""
        hit = self._hit(x, ("f",))
        if hit is not None:
            return hit
        return self._keep(x, ("f",), all_reduce_backward(x, self.group))

    def partial_grad(self, x: torch.Tensor) -> torch.Tensor:
        """For a replicated module reading the gathered input (an MoE router, MLA's
        ``kv_a_proj_with_mqa``): identity forward; backward keeps this rank's sequence block of
        its input gradient, which is the same on every rank, so the gather's reduce-scatter
        counts it once. ``x``: ``[B, S, H]`` or ``[B * S, H]`` of this forward's ``S``.

        Raises:
            ShardkitError: no sequence split in this forward (sizes unknown).
        """
        if self.info.size == 1:
            return x
        sizes = self._current("partial_grad")
        start = sum(sizes[: self.info.rank])
        return _PartialGradOfReplicated.apply(x, start, sizes[self.info.rank], sum(sizes))

    def _current(self, op: str) -> list[int]:
        if self.sizes is None:
            raise ShardkitError(
                f"SequenceSharding.{op}: no sequence split yet in this forward (the split must run first)"
            )
        return self.sizes

    # ---------------------------------------------------------------- cache
    def _hit(self, x: torch.Tensor, kind: tuple):
        """The prepared output for ``x``: ``x`` itself if it *is* the last prepared tensor, the
        cached output if ``x`` is its source (same kind, same grad mode), else None."""
        if self._last is None:
            return None
        src, k, out, mode = self._last
        if mode != torch.is_grad_enabled():
            return None  # a checkpointed recompute (grad on) gets a fresh entry
        if out is x:
            return x
        return out if k == kind and src() is x else None

    def _keep(self, x: torch.Tensor, kind: tuple, out: torch.Tensor) -> torch.Tensor:
        # The output is held strongly (a tensor whose only other owner is the autograd graph can be
        # freed and re-created, which a weak reference cannot follow); at most one is kept.
        self._last = (weakref.ref(x), kind, out, torch.is_grad_enabled())
        return out
