"""The per-expert math of a Hugging Face experts module, on rows already grouped by expert.

Below both :mod:`shardkit.tensor_parallel` (tensor-parallel experts hold every expert) and
:mod:`shardkit.expert_parallel` (each rank holds a block of experts), which run the same math;
:mod:`shardkit.expert_parallel.experts` is its public home (see there for the module layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["expert_forward", "grouped_experts_forward", "routed_experts_forward"]


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
    held here contribute nothing (the partial sum of the ``ep_router`` / all-reduce mode, and the
    whole output of tensor-parallel experts, which hold every expert: ``offset = 0``).

    Sort-based, with one device-to-host read: the (token, slot) pairs are sorted by local expert
    id (routes to experts held elsewhere go to one last bucket) and counted on the device; the
    counts are read once (``tolist``: the row counts of the experts' matmuls are host ints), and
    each expert runs on its contiguous block. A ``torch.where`` per expert (Hugging Face's eager
    loop) reads the device once per expert, plus once for the experts hit.

    Source: the Megatron-LM / torchtitan permute-by-sort of routed tokens.
    """
    stacked: torch.Tensor = (
        getattr(module, "gate_up_proj") if hasattr(module, "gate_up_proj") else getattr(module, "up_proj")
    )
    n, k = stacked.shape[0], topk_index.shape[1]  # the experts this module holds; slots per token
    local = topk_index.reshape(-1).long() - offset
    bucket = torch.where((local >= 0) & (local < n), local, n)  # not held here: bucket n, sorted last
    counts = torch.zeros(n + 1, dtype=torch.long, device=local.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # no bincount: its output size reads the device
    order = torch.argsort(bucket, stable=True)
    sizes = counts.tolist()  # the one host sync
    pairs = order[: local.numel() - sizes[n]]  # the held (token, slot) pairs, grouped by expert
    token = pairs // k
    y = grouped_experts_forward(module, hidden.index_select(0, token), sizes[:n], hidden.shape[1])
    w = topk_weights.reshape(-1).index_select(0, pairs)
    out = hidden.new_zeros(hidden.shape[0], hidden.shape[1])
    out = out.index_add(0, token, (y * w[:, None]).to(out.dtype))
    # Tie the output to both inputs even when no route lands here, so that this rank joins the
    # backward all-reduces of the shared inputs (an empty sum is an exact zero).
    return out + (hidden[:0].sum() + topk_weights[:0].sum()).to(out.dtype)
