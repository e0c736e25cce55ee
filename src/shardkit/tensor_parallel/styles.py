"""Parallel styles for linear layers: column-, row-wise and packed, applied to an existing module.

A style rewrites one module in place: it replaces the weight (and bias) by this rank's shard
(recording a :class:`~.spec.ShardSpec` on the new parameter) and adds the activation
communication the layer needs, with the Hugging Face plan strings' meaning:

* ``colwise``: weight ``[out, in]`` cut by output rows; the replicated input's gradient is
  summed over the group (Megatron's ``f``), the output ``[..., out_r]`` stays sharded
  (``colwise_gather_output``: all-gathered, the replicated gradient split back).
* ``rowwise``: weight cut by input columns; the partial output is all-reduced (Megatron's
  ``g``) and the replicated bias added once after it (``rowwise_split_input``: the replicated
  input is first split along its last dim).
* ``packed_colwise`` / ``packed_rowwise``: the same for fused weights (``gate_up_proj``): each
  rank gets its block of every packed part.

Sizes follow ``torch.chunk`` semantics (``ceil(n / R)`` per rank, last ranks short or empty)
unless the caller (or :func:`shardkit.apply_tp`'s attention-head layout) gives explicit ranges.
Styles also apply to a bare parameter named by a plan (the 3-D expert weights of MoE models):
then only the parameter is cut; the owning module's style does the communication.

Source: Megatron-LM column/row parallel linear layers (Shoeybi et al., 2019); plan strings of
Hugging Face transformers' tensor parallelism and PyTorch DTensor ``parallelize_module``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .._shapes import chunk_sizes
from ..comm import (
    _c10d,
    all_reduce_backward,
    all_reduce_forward,
    gather_forward_split_backward,
    split_forward_gather_backward,
)
from ..comm._group import GroupInfo, resolve_group
from ..errors import ShardkitError, ShardkitTypeError
from .spec import ShardSpec, shard_parameter, shard_spec

if TYPE_CHECKING:
    from typing import Any
    from .._types import Group

__all__ = [
    "StyleContext",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "sum_grad_over",
    "replace_input",
]


class SharedInputReduce:
    """Megatron's ``f`` applied once to an input that sibling colwise layers share.

    q/k/v (and gate/up) all read the same hidden states; wrapping that tensor once lets their
    three input gradients add up locally before a single all-reduce, instead of one all-reduce
    each (Megatron-LM fuses them the same way with one qkv matmul). The last input seen is held
    by weak reference and reused only for the identical tensor object under the same grad mode
    (a checkpointed recompute, run with grad enabled, gets a fresh ``f``). The wrapped tensor is
    held strongly (a Python tensor object whose only other owner is the autograd graph can be
    freed and re-created, which a weak reference cannot follow); it aliases the input, so this
    keeps at most one activation alive between steps.
    """

    def __init__(self, group) -> None:
        self.group = group
        self._key: tuple | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        grad_mode = torch.is_grad_enabled()
        if self._key is not None:
            x_ref, y, mode = self._key
            if x_ref() is x and mode == grad_mode:
                return y
        y = all_reduce_backward(x, self.group)
        self._key = (weakref.ref(x), y, grad_mode)
        return y


@dataclass
class StyleContext:
    """What a style needs besides the module: the group and, inside ``apply_tp``, the model.

    Attributes:
        group: the tp ``ProcessGroup`` or 1-D ``DeviceMesh``.
        info: the resolved group (size, rank).
        name: the module's (or parameter's) qualified name, for messages.
        model: the root model (its ``config`` is read by some styles), or None.
        memo: shared parameters already cut (tied weights), see :func:`.spec.shard_parameter`.
        ranges: explicit per-rank ranges of the sharded dim (whole attention heads), or None.
        input_reduce: the ``f`` shared by the colwise layers of one ``apply_tp`` call, or None
            (each colwise layer then applies its own).
    """

    group: Group
    info: GroupInfo
    name: str = ""
    model: nn.Module | None = None
    memo: dict = field(default_factory=dict)
    ranges: tuple | None = None
    input_reduce: SharedInputReduce | None = None

    @classmethod
    def of(cls, group: Group, op: str) -> StyleContext:
        return cls(group, resolve_group(group, op))


class ParallelStyle:
    """Base class: subclasses implement :meth:`apply_module` and :meth:`shard_param`."""

    def apply(self, module: nn.Module, group: Group) -> nn.Module:
        """Apply this style to ``module`` over ``group`` (a ``ProcessGroup`` or 1-D ``DeviceMesh``)."""
        self.apply_module(module, StyleContext.of(group, type(self).__name__))
        return module

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        raise ShardkitError(f"{type(self).__name__} cannot be applied to a module ({ctx.name})")

    def shard_param(self, module: nn.Module, pname: str, ctx: StyleContext) -> None:
        """A plan key named a parameter (``experts.gate_up_proj``): cut only that parameter."""
        raise ShardkitError(f"{type(self).__name__} cannot be applied to a bare parameter ({ctx.name})")


def replace_input(args: tuple, kwargs: dict, fn, name: str = "hidden_states"):
    """Apply ``fn`` to a module's first input, passed positionally or as keyword ``name``."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if name in kwargs:
        return args, {**kwargs, name: fn(kwargs[name])}
    if len(kwargs) == 1:
        key = next(iter(kwargs))
        return args, {key: fn(kwargs[key])}
    raise ShardkitError(f"tensor parallel hook: the module got neither a positional input nor {name}=")


def _chunks(n: int, R: int, unit: int, where: str) -> list[int]:
    """``torch.chunk`` sizes of ``n`` in whole units of ``unit`` elements (heads)."""
    if n % unit:
        raise ShardkitError(f"{where}: size {n} is not a whole number of units of {unit}")
    return [s * unit for s in chunk_sizes(n // unit, R)]


def _linear_spec(full: int, ctx: StyleContext, dim: int, parts: int | Sequence[int] | None, explicit,
                 unit: int = 1) -> ShardSpec:
    """The spec of a linear-like dim of size ``full``: explicit sizes, head ranges, packed, or chunk."""
    R = ctx.info.size
    where = ctx.name or "style"
    if explicit is not None:
        sizes = tuple(int(s) for s in explicit)
        if len(sizes) != R or any(s < 0 for s in sizes) or sum(sizes) != full:
            raise ShardkitError(
                f"{ctx.name or 'style'}: sizes {list(sizes)} must be {R} non-negative ints (one per rank of the "
                f"tp group) summing to {full}"
            )
        return ShardSpec.blocks(dim, sizes, ctx.group)
    if ctx.ranges is not None:
        return ShardSpec(dim, full, ctx.ranges, ctx.group)
    if parts is None:
        return ShardSpec.blocks(dim, _chunks(full, R, unit, where), ctx.group)
    blocks = [full // parts] * parts if isinstance(parts, int) else [int(p) for p in parts]
    if sum(blocks) != full or (isinstance(parts, int) and full % parts):
        raise ShardkitError(f"{where}: cannot split size {full} into packed parts {parts}")
    return ShardSpec.packed(dim, [_chunks(b, R, unit, where) for b in blocks], ctx.group)


def _weight(module: nn.Module, style: str, ctx: StyleContext) -> torch.Tensor:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        raise ShardkitTypeError(f"{style}: {ctx.name or type(module).__name__} has no 2-D weight to shard")
    if shard_spec(w) is not None:
        raise ShardkitError(f"{style}: {ctx.name or type(module).__name__} is already sharded")
    return w


class ColwiseParallel(ParallelStyle):
    """Shard a linear layer by output features; ``colwise`` / ``colwise_gather_output``.

    Input ``[..., in]`` replicated over the group; output ``[..., out_r]`` (this rank's output
    features), or ``[..., out]`` with ``gather_output``. Weight ``[out, in]`` -> ``[out_r, in]``,
    bias ``[out]`` -> ``[out_r]``.

    Args:
        sizes: output features per rank; None for ``torch.chunk`` semantics (or the head
            layout ``apply_tp`` computes for attention projections).
        gather_output: all-gather the output along the last dim (backward: keep this rank's
            block of the replicated gradient).
        reduce_input_grad: add Megatron's ``f`` on the input (its gradient is a partial sum per
            rank). Off when a plan reduces it elsewhere (sequence parallelism's reduce-scatter).
        parts: packed weights: the number of equal packed parts, or their sizes (a fused GQA
            ``qkv_proj``: ``[N * D, N_kv * D, N_kv * D]``).
        unit: cut in whole units of this many features (the head dim of a fused ``qkv_proj``).
    """

    weight_dim = -2

    def __init__(self, sizes: Sequence[int] | None = None, *, gather_output: bool = False,
                 reduce_input_grad: bool = True, parts: int | Sequence[int] | None = None, unit: int = 1) -> None:
        self.sizes, self.gather_output, self.reduce_input_grad, self.parts = sizes, gather_output, reduce_input_grad, parts
        self.unit = unit

    def _spec(self, full: int, ctx: StyleContext, dim: int) -> ShardSpec:
        return _linear_spec(full, ctx, dim, self.parts, self.sizes, self.unit)

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        w = _weight(module, type(self).__name__, ctx)
        dim = w.dim() - 2
        spec = self._spec(w.shape[dim], ctx, dim)
        shard_parameter(module, "weight", spec, ctx.info.rank, ctx.memo)
        if getattr(module, "bias", None) is not None:
            shard_parameter(module, "bias", ShardSpec(0, spec.full_size, spec.ranges, ctx.group), ctx.info.rank, ctx.memo)
        group = ctx.group
        if self.reduce_input_grad:
            f = ctx.input_reduce or (lambda x: all_reduce_backward(x, group))
            module.register_forward_pre_hook(
                lambda m, args, kwargs: replace_input(args, kwargs, f, "input"), with_kwargs=True)
        if self.gather_output:
            if spec.overlapping or len(spec.ranges[0]) != 1:
                raise ShardkitError(f"{ctx.name}: gather_output needs plain (not packed or replicated) shards")
            sizes = list(spec.sizes)
            module.register_forward_hook(lambda m, args, out: gather_forward_split_backward(out, group, -1, sizes))
        elif hasattr(module, "out_features"):
            module.out_features = spec.sizes[ctx.info.rank]

    def shard_param(self, module: nn.Module, pname: str, ctx: StyleContext) -> None:
        p = getattr(module, pname)
        dim = p.dim() - 1 if p.dim() == 1 else p.dim() + self.weight_dim
        shard_parameter(module, pname, self._spec(p.shape[dim], ctx, dim), ctx.info.rank, ctx.memo)


class PackedColwiseParallel(ColwiseParallel):
    """``packed_colwise``: :class:`ColwiseParallel` of a fused weight of ``parts`` (default 2) parts."""

    def __init__(self, sizes: Sequence[int] | None = None, *, parts: int | Sequence[int] = 2, **kwargs: Any) -> None:
        super().__init__(sizes, parts=parts, **kwargs)


def _rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # The replicated bias must be added once, after the partial sums are reduced; nn.Linear would
    # add it on every rank before the reduction (R times in the sum).
    out = self._shardkit_reduce(F.linear(x, self.weight))
    return out if self.bias is None else out + self.bias


class RowwiseParallel(ParallelStyle):
    """Shard a linear layer by input features and reduce its output; ``rowwise``.

    Input ``[..., in_r]`` is this rank's block of the input features (a colwise partner's
    output); the local matmul gives a partial sum ``[..., out]`` that ``reduce`` turns into the
    output. The bias stays replicated and is added once after the reduction.

    Args:
        sizes: input features per rank (must match the colwise partner); None for chunk
            semantics or ``apply_tp``'s head layout.
        split_input: ``rowwise_split_input``: the input is replicated; split its last dim first.
        reduce: maps the partial sum to the output; default all-reduce over the group
            (Megatron's ``g``). Sequence parallelism passes a reduce-scatter along the sequence.
        parts: packed weights (``packed_rowwise``).
        unit: cut in whole units of this many features (heads of an attention output).
    """

    weight_dim = -1

    def __init__(self, sizes: Sequence[int] | None = None, *, split_input: bool = False,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 parts: int | Sequence[int] | None = None, unit: int = 1) -> None:
        self.sizes, self.split_input, self.reduce, self.parts, self.unit = sizes, split_input, reduce, parts, unit

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        name = type(self).__name__
        w = _weight(module, name, ctx)
        if not isinstance(module, nn.Linear):
            raise ShardkitTypeError(f"{name}: expected an nn.Linear at {ctx.name or 'module'}, got {type(module).__name__}")
        spec = _linear_spec(w.shape[-1], ctx, w.dim() - 1, self.parts, self.sizes, self.unit)
        if spec.overlapping:
            raise ShardkitError(f"{name}: {ctx.name}: row-parallel input features cannot be replicated")
        shard_parameter(module, "weight", spec, ctx.info.rank, ctx.memo)
        module.in_features = spec.sizes[ctx.info.rank]
        group = ctx.group
        module._shardkit_reduce = self.reduce or (lambda y: all_reduce_forward(y, group))
        module.forward = types.MethodType(_rowwise_forward, module)
        if self.split_input:
            if len(spec.ranges[0]) != 1:
                raise ShardkitError(f"{name}: {ctx.name}: split_input needs plain (not packed) shards")
            sizes = list(spec.sizes)
            module.register_forward_pre_hook(
                lambda m, args, kwargs: replace_input(
                    args, kwargs, lambda x: split_forward_gather_backward(x, group, -1, sizes), "input"),
                with_kwargs=True,
            )

    def shard_param(self, module: nn.Module, pname: str, ctx: StyleContext) -> None:
        p = getattr(module, pname)
        if p.dim() == 1:
            return  # a row-parallel bias stays replicated
        dim = p.dim() - 1
        spec = _linear_spec(p.shape[dim], ctx, dim, self.parts, self.sizes, self.unit)
        shard_parameter(module, pname, spec, ctx.info.rank, ctx.memo)


class PackedRowwiseParallel(RowwiseParallel):
    """``packed_rowwise``: :class:`RowwiseParallel` of a fused weight of ``parts`` (default 2) parts."""

    def __init__(self, sizes: Sequence[int] | None = None, *, parts: int | Sequence[int] = 2, **kwargs: Any) -> None:
        super().__init__(sizes, parts=parts, **kwargs)


def sum_grad_over(param: nn.Parameter, group: Group) -> nn.Parameter:
    """Make ``param``'s gradient the sum over ``group`` of the per-rank gradients.

    For a replicated parameter applied to different data on each rank (an RMSNorm weight on a
    sequence block, a q/k norm on local heads): each rank's gradient is a partial sum.

    Why a tensor hook: a hook on a leaf runs once per backward with the total gradient of that
    backward, *before* ``AccumulateGrad`` writes ``.grad``. DDP's reducer hooks run after
    ``AccumulateGrad``, so DDP then averages the already tp-summed gradient over dp: the two
    compose. The alternative, ``all_reduce_backward(weight)`` through
    ``torch.nn.utils.parametrize``, renames the parameter (``parametrizations.weight.original``)
    and so changes state-dict keys and checkpoints. The hook calls the c10d helper directly
    (the gradient needs no autograd), so :class:`~shardkit.CommLedger` records it as
    ``op="all_reduce", api="sum_grad_over", phase="backward"``.

    Args:
        param: a leaf parameter, replicated over ``group``.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh``; a size-1 group adds no hook.

    Returns:
        ``param``.

    Raises:
        ShardkitTypeError: ``param`` is not a leaf tensor that requires grad, or a bad group.
    """
    if not isinstance(param, torch.Tensor) or not param.is_leaf or not param.requires_grad:
        raise ShardkitTypeError("sum_grad_over: expected a leaf parameter that requires grad")
    g = resolve_group(group, "sum_grad_over")  # fail now on a bad group, not inside backward
    if g.size > 1:
        param.register_hook(lambda grad: _c10d.all_reduce(grad, g, "sum_grad_over", "backward"))
    return param
