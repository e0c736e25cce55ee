"""Parallel styles for linear layers: column-, row-wise and packed, with input/output layouts.

A style rewrites one module in place: it replaces the weight (and bias) by this rank's shard
(recording a :class:`~shardkit.sharding.ShardSpec` on the new parameter) and adds the activation
communication its declared layouts need (:class:`~shardkit.sharding.Replicate` /
:class:`~shardkit.sharding.Shard`), as PyTorch DTensor's parallel styles do, on shardkit's own
collectives:

* ``ColwiseParallel(input_layouts=Replicate())`` (``colwise``): weight ``[out, in]`` cut by
  output rows; the replicated input's gradient is summed over the group (Megatron's ``f``,
  shared by siblings reading the same tensor). ``input_layouts=Shard(1)`` (sequence
  parallelism): the input ``[B, S_r, in]`` is all-gathered along the sequence (backward:
  reduce-scatter), instead of ``f``. ``output_layouts=Shard(-1)`` keeps ``[..., out_r]``;
  ``Replicate()`` all-gathers it (``colwise_gather_output``; backward keeps this rank's block).
* ``RowwiseParallel(output_layouts=Replicate())`` (``rowwise``): weight cut by input columns;
  the partial output is all-reduced (Megatron's ``g``) and the replicated bias added once after
  it. ``output_layouts=Shard(1)``: the partial sums are reduce-scattered along the sequence
  (backward: all-gather) and the bias is added to the local block, so its gradient is summed
  over the group. ``input_layouts=Replicate()`` (``rowwise_split_input``) splits the input's
  last dim first.
* :mod:`.prepare`: ``PrepareModuleInput`` / ``PrepareModuleOutput``, a layout change of a
  module's hidden-states input or output (the sequence gather before attention, shared by q/k/v).
* ``packed_colwise`` / ``packed_rowwise``: the same for fused weights (``gate_up_proj``): each
  rank gets its block of every packed part.

Sizes follow ``torch.chunk`` semantics (``ceil(n / R)`` per rank, last ranks short or empty)
unless the caller (or :func:`shardkit.apply_tp`'s attention-head layout) gives explicit ranges.
Styles also apply to a bare parameter named by a plan (the 3-D expert weights of MoE models):
then only the parameter is cut; the owning module's style does the communication.

Source: Megatron-LM column/row parallel linear layers (Shoeybi et al., 2019) and sequence
parallelism (Korthikanti et al., 2022); PyTorch DTensor's ``ColwiseParallel`` /
``RowwiseParallel`` / ``PrepareModuleInput`` layouts; Hugging Face transformers' plan strings.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import all_reduce_forward, gather_forward_split_backward, split_forward_gather_backward
from ..errors import ShardkitError, ShardkitTypeError
from ..sharding import Partial, Replicate, Shard, ShardSpec, check_layout, shard_parameter
from .embedding_shards import shard_embedding_columns, shard_embedding_rows
from .sp_saved import shard_saved_linear
from .style_base import (
    ParallelStyle,
    StyleContext,
    check_embedding_input,
    linear_like,
    linear_spec,
    refuse_module,
    replace_input,
    sum_grad_over,
    unsharded_weight,
)

if TYPE_CHECKING:
    from typing import Any


# Column-parallel projections that read their block's gathered input (Llama-family names, Qwen's
# fused ones, MLA's q_proj without a query LoRA): with async TP their matmuls run in that ring.
GATHER_READERS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj"})

__all__ = [
    "GATHER_READERS",
    "StyleContext",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "sum_grad_over",
    "replace_input",
]


class ColwiseParallel(ParallelStyle):
    """Shard a linear layer by output features; ``colwise`` / ``colwise_gather_output``.

    Weight ``[out, in]`` -> ``[out_r, in]``, bias ``[out]`` -> ``[out_r]``. Input ``[..., in]``
    replicated (or ``[B, S_r, in]`` with ``input_layouts=Shard(1)``); output ``[..., out_r]``
    (this rank's output features), or ``[..., out]`` with ``output_layouts=Replicate()``.

    On an ``nn.Embedding`` (as DTensor's ``ColwiseParallel``): the *embedding* features are cut,
    weight ``[V, H]`` -> ``[V, H_r]`` (dim 1, not the vocabulary); ids ``[...]`` replicated;
    output ``[..., H_r]`` with no communication, or ``[..., H]`` all-gathered with
    ``output_layouts=Replicate()``. Any other module type (a norm, a convolution) is refused.

    Args:
        sizes: output features per rank; None for ``torch.chunk`` semantics (or the head
            layout ``apply_tp`` computes for attention projections).
        input_layouts: ``Replicate()``: the input's gradient is a partial sum per rank, summed
            by Megatron's ``f`` (one ``f`` shared by siblings reading the same tensor; none if
            the input was prepared by a gather). ``Shard(d)``: all-gather along ``d`` (shared by
            siblings; backward reduce-scatter), sizes from the model's sequence split.
        output_layouts: ``Shard(-1)`` (default) or ``Replicate()`` (all-gather the output
            features; backward keeps this rank's block of the replicated gradient).
        reduce_input_grad: with a replicated input, False leaves the input gradient partial
            (a caller reduces it, e.g. a pipeline stage with ``input_grad="partial"``).
        parts: packed weights: the number of equal packed parts, or their sizes (a fused GQA
            ``qkv_proj``: ``[N * D, N_kv * D, N_kv * D]``).
        unit: cut in whole units of this many features (the head dim of a fused ``qkv_proj``).
        gather_output: deprecated (the last release's name): ``True`` is
            ``output_layouts=Replicate()``; removed in the next release.

    Raises:
        ShardkitTypeError: ``gather_output=`` together with ``output_layouts=``.
    """

    weight_dim = -2

    def __init__(
        self,
        sizes: Sequence[int] | None = None,
        *,
        input_layouts: Replicate | Shard = Replicate(),
        output_layouts: Replicate | Shard = Shard(-1),
        reduce_input_grad: bool = True,
        parts: int | Sequence[int] | None = None,
        unit: int = 1,
        gather_output: bool | None = None,
    ) -> None:
        if gather_output is not None:
            if output_layouts != Shard(-1):
                raise ShardkitTypeError("ColwiseParallel: gather_output= is the old name of output_layouts=; pass one")
            warnings.warn(
                "ColwiseParallel(gather_output=) is deprecated: use output_layouts=Replicate() (True) or leave the "
                "default Shard(-1) (False); gather_output= will be removed in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            output_layouts = Replicate() if gather_output else Shard(-1)
        self.sizes, self.parts, self.unit = sizes, parts, unit
        self.input_layouts = check_layout(input_layouts, "ColwiseParallel input_layouts")
        self.output_layouts = check_layout(output_layouts, "ColwiseParallel output_layouts")
        if isinstance(self.output_layouts, Shard) and self.output_layouts.dim != -1:
            raise ShardkitError(
                f"ColwiseParallel: output_layouts must be Shard(-1) or Replicate(), got {output_layouts!r}"
            )
        self.reduce_input_grad = reduce_input_grad

    def _spec(self, full: int, ctx: StyleContext, dim: int) -> ShardSpec:
        return linear_spec(full, ctx, dim, self.parts, self.sizes, self.unit)

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        name = type(self).__name__
        if isinstance(module, nn.Embedding):
            self._apply_embedding(module, ctx)
            return
        if not linear_like(module, getattr(module, "weight", None)):
            raise refuse_module(
                name, module, ctx, "nn.Linear (or a module with Linear's weight layout) and nn.Embedding"
            )
        w = unsharded_weight(module, name, ctx)
        dim = w.dim() - 2
        spec = self._spec(w.shape[dim], ctx, dim)
        shard_parameter(module, "weight", spec, ctx.info.rank, ctx.memo)
        if getattr(module, "bias", None) is not None:
            shard_parameter(
                module, "bias", ShardSpec(0, spec.full_size, spec.ranges, ctx.group), ctx.info.rank, ctx.memo
            )
        group, seq = ctx.group, ctx.seq
        assert seq is not None  # StyleContext.of and apply_tp always give one
        linear = module if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward else None
        if isinstance(self.input_layouts, Shard):
            d, name = self.input_layouts.dim, ctx.name
            if linear is not None:
                seq.add_reader(name, linear)  # async_tp: its own gather's ring runs its matmul
            module.register_forward_pre_hook(
                lambda m, args, kwargs: replace_input(args, kwargs, lambda x: seq.gather(x, d, name), "input"),
                with_kwargs=True,
            )
        elif self.reduce_input_grad:
            if linear is not None and ctx.name.rsplit(".", 1)[-1] in GATHER_READERS:
                seq.add_reader(ctx.name.rsplit(".", 1)[0], linear)  # reads its block's gathered input
            module.register_forward_pre_hook(
                lambda m, args, kwargs: replace_input(args, kwargs, seq.replicate, "input"), with_kwargs=True
            )
        if isinstance(self.output_layouts, Replicate):
            if spec.overlapping or len(spec.ranges[0]) != 1:
                raise ShardkitError(
                    f"{ctx.name}: output_layouts=Replicate() needs plain (not packed or replicated) shards"
                )
            sizes = list(spec.sizes)
            module.register_forward_hook(lambda m, args, out: gather_forward_split_backward(out, group, -1, sizes))
        elif hasattr(module, "out_features"):
            setattr(module, "out_features", spec.sizes[ctx.info.rank])  # an int, not a submodule
        if (seq.activation == "shard" or seq.async_tp) and linear is not None:
            # Megatron-style SP activations: keep the sequence shard, not the gathered input
            # (.sp_saved); async TP: the output its block's gather ring computed
            setattr(module, "forward", functools.partial(_colwise_forward, linear, seq))

    def _apply_embedding(self, module: nn.Embedding, ctx: StyleContext) -> None:
        """DTensor's ``ColwiseParallel`` on an embedding: cut its features (weight dim 1)."""
        name = type(self).__name__
        check_embedding_input(name, self.input_layouts, "", ctx)
        if self.parts is not None:
            raise ShardkitError(f"{name}: {ctx.name}: an nn.Embedding has no packed parts (got parts={self.parts})")
        w = unsharded_weight(module, name, ctx)
        spec = linear_spec(w.shape[1], ctx, 1, None, self.sizes, self.unit)
        gather = ctx.group if isinstance(self.output_layouts, Replicate) else None
        shard_embedding_columns(module, spec, ctx.info.rank, ctx.memo, gather, f"{name} at {ctx.name}")

    def shard_param(self, module: nn.Module, pname: str, ctx: StyleContext) -> None:
        p = getattr(module, pname)
        dim = p.dim() - 1 if p.dim() == 1 else p.dim() + self.weight_dim
        shard_parameter(module, pname, self._spec(p.shape[dim], ctx, dim), ctx.info.rank, ctx.memo)


class PackedColwiseParallel(ColwiseParallel):
    """``packed_colwise``: :class:`ColwiseParallel` of a fused weight of ``parts`` (default 2) parts."""

    def __init__(self, sizes: Sequence[int] | None = None, *, parts: int | Sequence[int] = 2, **kwargs: Any) -> None:
        super().__init__(sizes, parts=parts, **kwargs)


def _colwise_forward(self: nn.Linear, seq: Any, x: torch.Tensor) -> torch.Tensor:
    # a reader of the sequence all-gather keeps the shard; any other input is a plain linear
    y = seq.async_output(x, self)
    if y is not None:
        return y
    src = seq.shard_of(x)
    if src is None:
        return F.linear(x, self.weight, self.bias)
    return shard_saved_linear(x, src[0], self.weight, self.bias, src[1])


def _rowwise_forward(
    self: nn.Linear, matmul_reduce: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    # The replicated bias must be added once, after the partial sums are reduced; nn.Linear would
    # add it on every rank before the reduction (R times in the sum).
    out = matmul_reduce(x)
    return out if self.bias is None else out + self.bias


class RowwiseParallel(ParallelStyle):
    """Shard a linear layer by input features and reduce its output; ``rowwise``.

    Input ``[..., in_r]`` is this rank's block of the input features (a colwise partner's
    output); the local matmul gives a partial sum ``[..., out]``. The bias stays replicated and
    is added once, after the reduction.

    On an ``nn.Embedding`` (as DTensor's ``RowwiseParallel``, vocab-parallel): weight
    ``[V, H]`` -> ``[V_r, H]``; the ids must be declared replicated (``input_layouts=Replicate()``);
    each rank looks up the ids in its rows (zeros for the others) and the partial ``[..., H]`` is
    reduced by ``output_layouts`` as for a linear layer. Any other module type is refused.

    Args:
        sizes: input features per rank (must match the colwise partner); None for chunk
            semantics or ``apply_tp``'s head layout.
        input_layouts: ``Shard(-1)`` (default) or ``Replicate()`` (``rowwise_split_input``: the
            replicated input's last dim is split first; backward all-gathers).
        output_layouts: ``Replicate()``: all-reduce (Megatron's ``g``); ``Shard(d)`` (sequence
            parallelism): reduce-scatter along ``d`` with the model's sequence sizes (backward:
            all-gather). The bias is then added to the local block only, so its gradient is a
            partial sum and is summed over the group (:func:`sum_grad_over`). ``Partial()``: no
            reduction (a caller reduces the sum of several partial outputs once, e.g. an MoE
            block's shared experts with its routed experts); no bias allowed.
        parts: packed weights (``packed_rowwise``).
        unit: cut in whole units of this many features (heads of an attention output).
        split_input: deprecated (the last release's name): ``True`` is ``input_layouts=Replicate()``;
            warns ``DeprecationWarning``.
        reduce: removed in the last release (a callable on the partial sum); ``output_layouts``
            says the reduction now. Passing it raises.

    Raises:
        ShardkitTypeError: ``reduce=`` (naming ``output_layouts``); ``split_input=`` together
            with ``input_layouts=``.
        ShardkitError: ``input_layouts`` is a ``Shard`` other than ``Shard(-1)``.
    """

    weight_dim = -1

    def __init__(
        self,
        sizes: Sequence[int] | None = None,
        *,
        input_layouts: Replicate | Shard = Shard(-1),
        output_layouts: Replicate | Shard | Partial = Replicate(),
        parts: int | Sequence[int] | None = None,
        unit: int = 1,
        split_input: bool | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if reduce is not None:
            raise ShardkitTypeError(
                "RowwiseParallel(reduce=) was replaced in the last release by output_layouts=: Replicate() "
                "all-reduces (the old default), Shard(d) reduce-scatters along d (sequence parallelism), "
                "Partial() leaves the partial sums to the caller"
            )
        if split_input is not None:
            if input_layouts != Shard(-1):
                raise ShardkitTypeError("RowwiseParallel: split_input= is the old name of input_layouts=; pass one")
            warnings.warn(
                "RowwiseParallel(split_input=) is deprecated: use input_layouts=Replicate() (True) or leave the "
                "default Shard(-1) (False); split_input= will be removed in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            input_layouts = Replicate() if split_input else Shard(-1)
        self.sizes, self.parts, self.unit = sizes, parts, unit
        self.input_layouts = check_layout(input_layouts, "RowwiseParallel input_layouts")
        self.output_layouts = check_layout(output_layouts, "RowwiseParallel output_layouts", partial=True)
        if isinstance(self.input_layouts, Shard) and self.input_layouts.dim != -1:
            raise ShardkitError(
                f"RowwiseParallel: input_layouts must be Shard(-1) or Replicate(), got {input_layouts!r}"
            )

    def _reduce(self, ctx: StyleContext) -> Callable[[torch.Tensor], torch.Tensor]:
        """How the partial outputs are combined: ``output_layouts``' collective (or none)."""
        group, seq = ctx.group, ctx.seq
        assert seq is not None  # StyleContext.of and apply_tp always give one
        if isinstance(self.output_layouts, Partial):
            return lambda y: y
        if isinstance(self.output_layouts, Shard):
            d = self.output_layouts.dim
            return lambda y: seq.reduce_scatter(y, d)
        return lambda y: all_reduce_forward(y, group)

    def _matmul_reduce(self, module: nn.Linear, ctx: StyleContext) -> Callable[[torch.Tensor], torch.Tensor]:
        """The partial output's matmul and its reduction: one ring (async TP) for a sequence
        reduce-scatter, else ``F.linear`` then :meth:`_reduce`."""
        seq = ctx.seq
        assert seq is not None
        if isinstance(self.output_layouts, Shard) and seq.async_tp:
            d = self.output_layouts.dim
            return lambda x: seq.linear_reduce_scatter(x, module.weight, d)
        reduce = self._reduce(ctx)
        return lambda x: reduce(F.linear(x, module.weight))

    def _apply_embedding(self, module: nn.Embedding, ctx: StyleContext) -> None:
        """DTensor's ``RowwiseParallel`` on an embedding: cut its vocabulary (weight dim 0)."""
        name = type(self).__name__
        check_embedding_input(name, self.input_layouts, "; RowwiseParallel's default Shard(-1) is for nn.Linear", ctx)
        if self.parts is not None:
            raise ShardkitError(f"{name}: {ctx.name}: an nn.Embedding has no packed parts (got parts={self.parts})")
        w = unsharded_weight(module, name, ctx)
        spec = linear_spec(w.shape[0], ctx, 0, None, self.sizes, self.unit)
        shard_embedding_rows(module, spec, ctx.info.rank, ctx.memo, self._reduce(ctx))

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        name = type(self).__name__
        if isinstance(module, nn.Embedding):
            self._apply_embedding(module, ctx)
            return
        if not isinstance(module, nn.Linear):
            raise refuse_module(name, module, ctx, "nn.Linear and nn.Embedding")
        w = unsharded_weight(module, name, ctx)
        spec = linear_spec(w.shape[-1], ctx, w.dim() - 1, self.parts, self.sizes, self.unit)
        if spec.overlapping:
            raise ShardkitError(f"{name}: {ctx.name}: row-parallel input features cannot be replicated")
        shard_parameter(module, "weight", spec, ctx.info.rank, ctx.memo)
        module.in_features = spec.sizes[ctx.info.rank]
        group = ctx.group
        if isinstance(self.output_layouts, Partial) and module.bias is not None:
            raise ShardkitError(f"{name}: {ctx.name}: output_layouts=Partial() with a bias (it would be added R times)")
        if isinstance(self.output_layouts, Shard) and module.bias is not None and module.bias.requires_grad:
            sum_grad_over(module.bias, group)  # added to this rank's block only: partial gradient
        # an instance attribute shadows the class's forward (setattr: a method assignment on purpose)
        setattr(module, "forward", functools.partial(_rowwise_forward, module, self._matmul_reduce(module, ctx)))
        if isinstance(self.input_layouts, Replicate):
            if len(spec.ranges[0]) != 1:
                raise ShardkitError(f"{name}: {ctx.name}: a replicated input needs plain (not packed) shards")
            sizes = list(spec.sizes)
            module.register_forward_pre_hook(
                lambda m, args, kwargs: replace_input(
                    args, kwargs, lambda x: split_forward_gather_backward(x, group, -1, sizes), "input"
                ),
                with_kwargs=True,
            )

    def shard_param(self, module: nn.Module, pname: str, ctx: StyleContext) -> None:
        p = getattr(module, pname)
        if p.dim() == 1:
            return  # a row-parallel bias stays replicated
        dim = p.dim() - 1
        spec = linear_spec(p.shape[dim], ctx, dim, self.parts, self.sizes, self.unit)
        shard_parameter(module, pname, spec, ctx.info.rank, ctx.memo)


class PackedRowwiseParallel(RowwiseParallel):
    """``packed_rowwise``: :class:`RowwiseParallel` of a fused weight of ``parts`` (default 2) parts."""

    def __init__(self, sizes: Sequence[int] | None = None, *, parts: int | Sequence[int] = 2, **kwargs: Any) -> None:
        super().__init__(sizes, parts=parts, **kwargs)
