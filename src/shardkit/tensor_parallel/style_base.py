"""The base of every tensor-parallel style: :class:`ParallelStyle`, the :class:`StyleContext` it
receives, and the helpers the linear and embedding styles share (shard sizes, the refusal of a
module type a style cannot cut, the gradient sum of a replicated parameter).

Source: PyTorch DTensor's ``ParallelStyle`` (one object per plan rule, applied to one module);
Megatron-LM's column/row parallel layers for the shard sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._shapes import chunk_sizes
from ..comm import _c10d
from ..comm._group import GroupInfo, resolve_group
from ..errors import ShardkitError, ShardkitTypeError
from ..sharding import Replicate, ShardSpec, shard_spec
from .sequence import SequenceSharding

if TYPE_CHECKING:
    from .._types import Group

__all__ = [
    "StyleContext",
    "ParallelStyle",
    "replace_input",
    "sum_grad_over",
    "chunks_in_units",
    "linear_spec",
    "refuse_module",
    "linear_like",
    "unsharded_weight",
    "check_embedding_input",
]


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
        seq: the model's :class:`~.sequence.SequenceSharding` (sequence sizes of the current
            forward, prepared inputs shared by sibling layers).
    """

    group: Group
    info: GroupInfo
    name: str = ""
    model: nn.Module | None = None
    memo: dict = field(default_factory=dict)
    ranges: tuple | None = None
    seq: SequenceSharding | None = None

    @classmethod
    def of(cls, group: Group, op: str, seq: SequenceSharding | None = None) -> StyleContext:
        return cls(group, resolve_group(group, op), seq=seq or SequenceSharding(group))


class ParallelStyle:
    """Base class: subclasses implement :meth:`apply_module` and :meth:`shard_param`."""

    def apply(self, module: nn.Module, group: Group, *, seq: SequenceSharding | None = None) -> nn.Module:
        """Apply this style to ``module`` over ``group`` (a ``ProcessGroup`` or 1-D ``DeviceMesh``).

        Styles applied by hand to one model should share one ``seq`` (its sequence sizes and
        prepared inputs); each call without it gets a fresh one.
        """
        self.apply_module(module, StyleContext.of(group, type(self).__name__, seq))
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


def chunks_in_units(n: int, R: int, unit: int, where: str) -> list[int]:
    """``torch.chunk`` sizes of ``n`` in whole units of ``unit`` elements (heads)."""
    if n % unit:
        raise ShardkitError(f"{where}: size {n} is not a whole number of units of {unit}")
    return [s * unit for s in chunk_sizes(n // unit, R)]


def linear_spec(
    full: int, ctx: StyleContext, dim: int, parts: int | Sequence[int] | None, explicit, unit: int = 1
) -> ShardSpec:
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
        return ShardSpec.blocks(dim, chunks_in_units(full, R, unit, where), ctx.group)
    blocks = [full // parts] * parts if isinstance(parts, int) else [int(p) for p in parts]
    if sum(blocks) != full or (isinstance(parts, int) and full % parts):
        raise ShardkitError(f"{where}: cannot split size {full} into packed parts {parts}")
    return ShardSpec.packed(dim, [chunks_in_units(b, R, unit, where) for b in blocks], ctx.group)


def refuse_module(style: str, module: nn.Module, ctx: StyleContext, takes: str) -> ShardkitTypeError:
    """The error for a module type ``style`` cannot shard, naming what to use instead."""
    w = getattr(module, "weight", None)
    what = "" if isinstance(w, torch.Tensor) and w.dim() >= 2 else ", which has no 2-D weight to shard"
    return ShardkitTypeError(
        f"{style}: {ctx.name or 'the module'} is a {type(module).__name__}{what}; {style} shards {takes}. "
        "A module whose parameters stay replicated (a norm) takes SequenceParallel() on a sequence-sharded "
        "input or ReplicatedWithGradAllReduce(); a convolution takes shardkit.spatial.apply_spatial"
    )


def linear_like(module: nn.Module, w: torch.Tensor | None) -> bool:
    """An ``nn.Linear``, or a module whose weight is ``[..., out_features, in_features]`` (Linear's layout)."""
    if isinstance(module, nn.Linear):
        return True
    return (
        isinstance(w, torch.Tensor)
        and w.dim() >= 2
        and getattr(module, "out_features", None) == w.shape[-2]
        and getattr(module, "in_features", None) == w.shape[-1]
    )


def unsharded_weight(module: nn.Module, style: str, ctx: StyleContext) -> torch.Tensor:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        raise ShardkitTypeError(f"{style}: {ctx.name or type(module).__name__} has no 2-D weight to shard")
    if shard_spec(w) is not None:
        raise ShardkitError(f"{style}: {ctx.name or type(module).__name__} is already sharded")
    return w


def check_embedding_input(style: str, layout: object, want: str, ctx: StyleContext) -> None:
    """An embedding's ids are replicated: refuse another declared input layout."""
    if not isinstance(layout, Replicate):
        raise ShardkitError(
            f"{style}: {ctx.name or 'the module'} is an nn.Embedding, whose input ids must be replicated: "
            f"pass input_layouts=Replicate() (got {layout!r}{want})"
        )


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
        # Tagged so that transforms replacing parameters (FSDP2's fully_shard) can leave this
        # one alone: the hook lives on this exact tensor object.
        setattr(param, "_shardkit_grad_hook", True)
    return param
