"""Tensor-parallel MoE experts: ``moe_tp_experts`` and ``moe_identity_expert``.

With ``moe_tp_experts`` every rank holds every expert, each cut like an MLP (``gate_up_proj``
packed-colwise, ``down_proj`` rowwise; the plan cuts those parameters). The experts module is
called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` and returns the
weighted sum of this rank's partial expert outputs, so:

* the output is all-reduced (Megatron's ``g``);
* ``hidden``'s gradient is a partial sum (only this rank's intermediate features): ``f``;
* ``top_k_weights``' gradient is ``<dL/dout, expert_out_partial>``, also partial: ``f``, which
  makes the router's gradient exact and identical on every rank.

Under transformers' eager experts implementation the module's forward is replaced by the same
math run sort-based (one host sync per layer instead of one per expert; see
:func:`_sort_based_eager_forward`).

``moe_identity_expert`` (zero-compute identity experts, e.g. LongCat-Flash): their output is the
same on every rank, so under the summed output it would count ``R`` times; the input is divided
by ``R``.

Source: Hugging Face transformers' plan strings of the same names; Megatron-LM's ``f``/``g``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .._experts import routed_experts_forward
from ..comm import all_reduce_backward, all_reduce_forward
from ..comm._group import resolve_group
from ..errors import ShardkitTypeError
from ..sharding import Partial, Replicate, check_layout
from .style_base import ParallelStyle, StyleContext

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["MoeTensorParallelExperts", "MoeIdentityExpert", "identity_expert_parallel"]


class MoeTensorParallelExperts(ParallelStyle):
    """``f`` on the experts' hidden states and routing weights, ``g`` on their output.

    Args:
        reduce_input_grad: False leaves the hidden states' gradient partial (sequence
            parallelism: the block's sequence gather reduce-scatters it).
        output_layouts: ``Replicate()`` (all-reduce) or ``Partial()`` (no reduction: the block
            reduces the sum of routed and shared experts once).
    """

    def __init__(self, *, reduce_input_grad: bool = True, output_layouts: Replicate | Partial = Replicate()) -> None:
        self.reduce_input_grad = reduce_input_grad
        self.output_layouts = check_layout(output_layouts, "MoeTensorParallelExperts output_layouts", partial=True)

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        if not isinstance(getattr(module, "num_experts", None), int):
            # on another module the all-reduced output would count a replicated result R times
            raise ShardkitTypeError(
                f"MoeTensorParallelExperts: {ctx.name or 'the module'} is a {type(module).__name__} without "
                "num_experts; it takes a transformers experts module (forward(hidden_states, top_k_index, "
                "top_k_weights)); shard a linear layer with ColwiseParallel / RowwiseParallel"
            )
        group = ctx.group
        reduced = ((0, "hidden_states"),) if self.reduce_input_grad else ()

        def pre(m, args, kwargs):
            args, kwargs = list(args), dict(kwargs)
            for pos, key in reduced + ((2, "top_k_weights"),):
                if len(args) > pos:
                    args[pos] = all_reduce_backward(args[pos], group)
                elif key in kwargs:
                    kwargs[key] = all_reduce_backward(kwargs[key], group)
            return tuple(args), kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)
        _sort_based_eager_forward(module)
        if not isinstance(self.output_layouts, Partial):
            module.register_forward_hook(lambda m, args, out: all_reduce_forward(out, group))


def _sort_based_eager_forward(module: nn.Module) -> None:
    """Run Hugging Face's eager experts loop sort-based, with one host sync instead of one per expert.

    The eager implementation (transformers' ``@use_experts_implementation`` default, what the
    trainer selects) finds each hit expert's tokens with a ``torch.where`` and tests the expert id
    on the host: a device-to-host read per expert. :func:`shardkit._experts.routed_experts_forward`
    computes the same sum (every expert, this rank's slice of its features) from one sort by
    expert id and one read of the counts. Other implementations (``grouped_mm``, ``batched_mm``,
    ...) the user chose are left as they are.
    """
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "eager"):
        return
    if not (hasattr(module, "gate_up_proj") or hasattr(module, "up_proj")) or not hasattr(module, "down_proj"):
        return  # not a transformers experts module: its own forward is the math

    def forward(hidden_states, top_k_index, top_k_weights):
        return routed_experts_forward(module, hidden_states, top_k_index, top_k_weights, 0).to(hidden_states.dtype)

    module.forward = forward


class MoeIdentityExpert(ParallelStyle):
    """Divide the input by the group size (its output is summed over the group downstream)."""

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        if any(True for _ in module.parameters()):
            # a module with weights is no identity expert: scaling its input would be silently wrong
            raise ShardkitTypeError(
                f"MoeIdentityExpert: {ctx.name or 'the module'} is a {type(module).__name__} with parameters; "
                "it takes a parameter-free identity ('zero') expert inside a summed experts module"
            )
        identity_expert_parallel(module, ctx.group)


def identity_expert_parallel(module: nn.Module, group: Group) -> torch.utils.hooks.RemovableHandle:
    """The ``moe_identity_expert`` style: divide the module's first input by ``R``.

    For identity ("zero") experts inside an experts module whose output is summed over the
    group (``moe_tp_experts`` / ``mode="local"``): every rank computes the same identity output,
    so the sum counts it ``R`` times; scaling the input by ``1 / R`` makes it count once, with an
    exact gradient once the input's gradient is summed over the group (``all_reduce_backward``).

    Returns:
        The forward pre-hook handle (``handle.remove()`` undoes it).

    Raises:
        ShardkitTypeError: ``module`` is not an ``nn.Module`` or ``group`` is not a group.

    Source: Hugging Face ``MoeIdentityExpertParallel`` (LongCat-Flash zero experts).
    """
    if not isinstance(module, nn.Module):
        raise ShardkitTypeError(f"identity_expert_parallel: expected an nn.Module, got {type(module).__name__}")
    size = resolve_group(group, "identity_expert_parallel").size

    def pre_hook(_mod, args):
        return (args[0] / size, *args[1:]) if size > 1 else None

    return module.register_forward_pre_hook(pre_hook)
