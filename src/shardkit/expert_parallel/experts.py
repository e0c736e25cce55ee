"""Run a Hugging Face experts module's own math on this rank's experts.

Hugging Face (transformers >= 5) stores the experts of a MoE layer as 3-D parameters of one
module decorated with ``@use_experts_implementation``: ``gate_up_proj [E, 2I, H]`` (or
``up_proj [E, I, H]`` when ``has_gate=False``), ``down_proj [E, H, I]``, optional ``*_bias
[E, ...]``, transposed layouts (``is_transposed``: ``[E, H, 2I]`` / ``[E, I, H]``), a gating
function ``_apply_gate`` (default: ``act_fn(gate) * up`` on the concatenated halves; models with
an interleaved layout or clamped activations override it) and an optional
``post_expert_norm``. The functions here apply exactly that per-expert math, expert by
expert, on rows already grouped by expert, so a sharded module needs no HF forward.

Every local expert runs even on zero rows (an empty matmul), so its parameters always take
part in backward and get a (zero) gradient instead of ``None``: data-parallel reducers then see
the same parameters on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["expert_forward", "grouped_experts_forward", "routed_experts_forward", "expert_param_names"]


def expert_param_names(module: nn.Module) -> list[str]:
    """Names of the module's own per-expert parameters: leading dim = ``module.num_experts``."""
    n = getattr(module, "num_experts", None)
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == n]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ w if transposed else F.linear(x, w)
    return out if b is None else out + b


def expert_forward(module: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` (index into the module's own parameters) on rows ``x [N, H]``; unweighted.

    Raises:
        ShardkitError: the module has neither ``gate_up_proj`` nor ``up_proj``, or no ``down_proj``.
    """
    has_gate = getattr(module, "has_gate", hasattr(module, "gate_up_proj"))
    has_bias = getattr(module, "has_bias", False)
    transposed = getattr(module, "is_transposed", False)
    first = "gate_up_proj" if has_gate else "up_proj"
    if not hasattr(module, first) or not hasattr(module, "down_proj"):
        raise ShardkitError(
            f"expert_forward: {type(module).__name__} has no {first}/down_proj 3-D expert parameters "
            "(expected a transformers experts module)"
        )
    experts: Any = module  # a transformers experts module: attributes by convention, checked above
    bias = getattr(experts, first + "_bias")[e] if has_bias else None
    h = _linear(x, getattr(experts, first)[e], bias, transposed)
    if has_gate:
        if hasattr(experts, "_apply_gate"):
            h = experts._apply_gate(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            h = experts.act_fn(gate) * up
    else:
        h = experts.act_fn(h)
    bias = experts.down_proj_bias[e] if has_bias else None
    y = _linear(h, experts.down_proj[e], bias, transposed)
    if getattr(experts, "has_post_expert_norm", False):
        y = experts.post_expert_norm(y)
    return y


def grouped_experts_forward(
    module: nn.Module, x: torch.Tensor, tokens_per_expert: Sequence[int] | torch.Tensor, out_dim: int
) -> torch.Tensor:
    """Rows grouped by expert (``tokens_per_expert[l]`` rows for expert ``l``) -> ``[N, out_dim]``.

    The output of :func:`shardkit.expert_parallel.token_dispatch` feeds this directly.
    """
    outs = []
    off = 0
    for e, n in enumerate(tokens_per_expert):
        outs.append(expert_forward(module, e, x.narrow(0, off, n)))
        off += n
    if not outs:  # no local experts
        return x.new_zeros(x.shape[0], out_dim)
    return torch.cat(outs).to(x.dtype)


def routed_experts_forward(
    module: nn.Module, hidden: torch.Tensor, topk_index: torch.Tensor, topk_weights: torch.Tensor, offset: int
) -> torch.Tensor:
    """Weighted contribution of the module's experts (global ids ``offset + e``) to every token.

    ``hidden [T, H]``, ``topk_index``/``topk_weights [T, k]`` -> ``[T, H]``; routes to experts not
    held here contribute nothing (the partial sum of the ``ep_router`` / all-reduce mode).
    """
    out = hidden.new_zeros(hidden.shape[0], hidden.shape[1])
    stacked: torch.Tensor = (
        getattr(module, "gate_up_proj") if hasattr(module, "gate_up_proj") else getattr(module, "up_proj")
    )
    for e in range(stacked.shape[0]):  # the experts this module holds
        token, slot = torch.where(topk_index == offset + e)
        y = expert_forward(module, e, hidden.index_select(0, token))
        out = out.index_add(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))
    # Tie the output to both inputs even when no route lands here, so that this rank joins the
    # backward all-reduces of the shared inputs (an empty sum is an exact zero).
    return out + (hidden[:0].sum() + topk_weights[:0].sum()).to(out.dtype)
