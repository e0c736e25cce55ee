"""Expert capacity at the router, per token group: which (token, slot) pairs a router call keeps.

Megatron-LM applies the capacity rule (:mod:`.capacity`) to the tokens one rank routes in one
call. A single process that reproduces a parallel run routes the tokens of several ranks (and
microbatches) in one call, so it must apply the rule to each of those token groups on its own,
in the order the rank saw its tokens (``drop_policy="position"`` drops the later ones).
:func:`grouped_capacity_keep` does that for any partition of the call's tokens; with one group
(``groups=None``) it is :func:`.capacity.apply_capacity` on the whole call.

The router then multiplies the routing weights by the mask: a dropped pair contributes zero to
its token's output and its weight gets a zero gradient, the same output and gradients as a
dispatcher that never sends it (the block's residual carries the token on).

Source: Megatron-LM ``moe_utils.get_capacity`` / ``topk_routing_with_score_function`` (the rule
per rank's tokens); the token groups of shardkit's trainer are in ``docs/guides/expert.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShardkitError
from .capacity import apply_capacity

__all__ = ["grouped_capacity_keep"]


def grouped_capacity_keep(
    topk_index: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    *,
    drop_policy: str = "probs",
    groups: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[T, k]`` bool: the pairs kept when each group of tokens gets its own capacity.

    Args:
        topk_index: ``[T, k]`` expert ids of the call's tokens.
        topk_weights: ``[T, k]`` their routing weights (``drop_policy="probs"`` ranks by them).
        num_experts: ``E``.
        capacity_factor: ``f > 0``; a group of ``T_g`` tokens gives each expert
            ``ceil(T_g * k / E * f)`` pairs.
        drop_policy: ``"probs"`` or ``"position"`` (see :mod:`.capacity`).
        groups: int64 index tensors into the ``T`` tokens, each a group in the order its rank
            routes it; together every token exactly once. None: one group, the call in order.

    Raises:
        ShardkitError: the groups do not cover every token exactly once; bad capacity
            arguments (:func:`.capacity.check_capacity_args`).
    """
    if groups is None:
        return apply_capacity(topk_index, topk_weights, num_experts, capacity_factor, drop_policy=drop_policy).keep
    num_tokens = topk_index.shape[0]
    seen = sum(int(g.numel()) for g in groups)
    order = torch.cat(list(groups)) if groups else topk_index.new_zeros(0, dtype=torch.int64)
    # a pure function of the call's shape and the groups: the same verdict on every rank
    if seen != num_tokens or torch.unique(order).numel() != num_tokens:
        raise ShardkitError(
            f"grouped_capacity_keep: the {len(groups)} token groups hold {seen} tokens, "
            f"{torch.unique(order).numel()} distinct; the call routes {num_tokens}: each token must be in one group"
        )
    keep = torch.empty_like(topk_index, dtype=torch.bool)
    for g in groups:
        g = g.to(topk_index.device)
        part = apply_capacity(
            topk_index.index_select(0, g),
            topk_weights.index_select(0, g),
            num_experts,
            capacity_factor,
            drop_policy=drop_policy,
        )
        keep[g] = part.keep
    return keep
