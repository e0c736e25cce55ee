"""Parallel styles for ``nn.Linear`` and replicated parameters, applied to an existing module.

A style rewrites one module in place: it replaces the weight (and bias) by this rank's shard and
records how the shard was cut on the new parameter (:class:`ShardSpec`), so that the full
tensor can be gathered back later (:mod:`.gather`). Activations are not touched here except by
:class:`RowwiseParallel`, whose partial output must be reduced before the bias is added; the
plan (e.g. :func:`shardkit.tensor_parallel.apply_llama_tp`) decides where activations are
gathered or split.

Source: Megatron-LM column/row parallel linear layers (Shoeybi et al., 2019), named after the
PyTorch / Hugging Face plan strings ``colwise`` and ``rowwise``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._shapes import split_offsets
from ..comm import _c10d, all_reduce_forward
from ..comm._group import resolve_group
from ..errors import ShardkitError, ShardkitTypeError

__all__ = ["ShardSpec", "ColwiseParallel", "RowwiseParallel", "shard_spec", "sum_grad_over"]

# Attribute set on every sharded nn.Parameter. Kept on the parameter (not in a table keyed by
# name) so that it survives wrapping (DDP renames parameters to "module.*") and optimizers.
_SPEC_ATTR = "_shardkit_shard"


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter was sharded: rank ``r`` holds block ``r`` of ``sizes`` along ``dim``.

    Attributes:
        dim: the sharded dim of the full tensor.
        sizes: per-rank block sizes along ``dim``; they sum to the full size.
        group: the ``ProcessGroup`` or 1-D ``DeviceMesh`` the shards live on.
    """

    dim: int
    sizes: tuple[int, ...]
    group: object


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` of a sharded parameter, or None for a replicated one."""
    return getattr(param, _SPEC_ATTR, None)


def _check_linear(module, style: str) -> None:
    if not isinstance(module, nn.Linear):
        raise ShardkitTypeError(f"{style}: expected an nn.Linear, got {type(module).__name__}")
    if shard_spec(module.weight) is not None:
        raise ShardkitError(f"{style}: this nn.Linear is already sharded ({shard_spec(module.weight)})")


def _check_sizes(sizes: Sequence[int], full: int, world: int, style: str, what: str) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != world or any(s < 0 for s in sizes) or sum(sizes) != full:
        raise ShardkitError(
            f"{style}: {what} sizes {list(sizes)} must be {world} non-negative ints (one per rank of the "
            f"tp group) summing to {full}"
        )
    return sizes


def _shard(param: nn.Parameter, dim: int, sizes: tuple[int, ...], rank: int, group) -> nn.Parameter:
    """A new parameter holding block ``rank`` of ``param`` along ``dim`` (a copy: owns its memory)."""
    block = param.detach().narrow(dim, split_offsets(sizes)[rank], sizes[rank]).clone()
    out = nn.Parameter(block, requires_grad=param.requires_grad)
    setattr(out, _SPEC_ATTR, ShardSpec(dim, sizes, group))
    return out


class ColwiseParallel:
    """Shard an ``nn.Linear`` by output features (weight rows, bias entries).

    Input ``[..., in]`` must be replicated over the group (or gathered by the plan); output is
    ``[..., sizes[rank]]``, this rank's block of the output features. The backward of the input
    is a partial sum per rank: the plan reduces it (Megatron's ``f`` or the reduce-scatter that
    is the adjoint of a sequence all-gather).

    Args:
        sizes: output features per rank, summing to ``out_features`` (e.g. whole heads per rank
            times the head dim for q/k/v projections).
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = sizes

    def apply(self, module: nn.Linear, group) -> nn.Linear:
        """Replace ``module``'s weight ``[out, in]`` by ``[sizes[rank], in]`` (bias likewise).

        Raises:
            ShardkitTypeError: ``module`` is not an ``nn.Linear``.
            ShardkitError: sizes do not match ``out_features`` and the group size, or the module
                is already sharded.
        """
        _check_linear(module, "ColwiseParallel")
        g = resolve_group(group, "ColwiseParallel")
        sizes = _check_sizes(self.sizes, module.out_features, g.size, "ColwiseParallel", "out_features")
        module.weight = _shard(module.weight, 0, sizes, g.rank, group)
        if module.bias is not None:
            module.bias = _shard(module.bias, 0, sizes, g.rank, group)
        module.out_features = sizes[g.rank]
        return module


def _rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # The replicated bias must be added once, after the partial sums are reduced; nn.Linear would
    # add it on every rank before the reduction (R times in the sum).
    out = self._shardkit_reduce(F.linear(x, self.weight))
    return out if self.bias is None else out + self.bias


class RowwiseParallel:
    """Shard an ``nn.Linear`` by input features (weight columns); reduce its output.

    Input ``[..., sizes[rank]]`` is this rank's block of the input features (the output of a
    :class:`ColwiseParallel` partner); the local matmul gives a partial sum ``[..., out]`` which
    ``reduce`` turns into the output. The bias, if any, stays replicated and is added once after
    the reduction, so its gradient is the (replicated) downstream gradient: no reduction needed.

    Args:
        sizes: input features per rank; must match the colwise partner's output sizes.
        reduce: maps the partial sum to the output; default all-reduce
            (:func:`shardkit.all_reduce_forward` over the group, Megatron's ``g``). Sequence
            parallelism passes a reduce-scatter along the sequence dim instead.
    """

    def __init__(self, sizes: Sequence[int], reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.sizes = sizes
        self.reduce = reduce

    def apply(self, module: nn.Linear, group) -> nn.Linear:
        """Replace ``module``'s weight ``[out, in]`` by ``[out, sizes[rank]]`` and its forward.

        The forward is replaced on the instance (parameter names stay ``weight``/``bias``, so
        state dicts and DDP see the same module); hooks registered on the module still run.

        Raises:
            ShardkitTypeError, ShardkitError: as :meth:`ColwiseParallel.apply`.
        """
        _check_linear(module, "RowwiseParallel")
        g = resolve_group(group, "RowwiseParallel")
        sizes = _check_sizes(self.sizes, module.in_features, g.size, "RowwiseParallel", "in_features")
        module.weight = _shard(module.weight, 1, sizes, g.rank, group)
        module.in_features = sizes[g.rank]
        module._shardkit_reduce = self.reduce or (lambda y: all_reduce_forward(y, group))
        module.forward = types.MethodType(_rowwise_forward, module)
        return module


def sum_grad_over(param: nn.Parameter, group) -> nn.Parameter:
    """Make ``param``'s gradient the sum over ``group`` of the per-rank gradients.

    For a replicated parameter applied to different data on each rank (an RMSNorm weight on a
    sequence block): each rank's gradient is a partial sum over its tokens.

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
