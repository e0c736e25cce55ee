"""Expert capacity and token dropping (Megatron-LM's ``moe_expert_capacity_factor``).

Dropless routing (every (token, slot) pair reaches its expert) stays the default. With a
capacity factor ``f``, each expert takes at most

    ``C = ceil(T * k / E * f)``

(token, slot) pairs of the ``T`` tokens routed in one call (``k`` slots per token, ``E``
experts), chosen by ``drop_policy``:

* ``"probs"``: the ``C`` pairs with the highest routing weight (ties: the earlier token);
* ``"position"``: the ``C`` earliest tokens routed to the expert.

A dropped pair contributes zero to its token's output, and its routing weight gets a zero
gradient (the residual connection around the MoE layer carries the token on). With
``pad_to_capacity``, every expert gets exactly ``min(C, T)`` pairs: its kept pairs plus
zero-weight filler pairs of tokens not routed to it (the highest-weight, then earliest, as
Megatron's capacity mask picks them), so the expert GEMMs and all-to-all sizes are fixed; the
output and every gradient equal those without padding.

``T`` is the set of tokens the router scored in the call: the experts module's input. With
replicated tokens (every rank routes the same batch) the rule is applied before the tokens are
split over the ranks, so expert parallelism changes nothing; with sharded tokens (each rank its
own, Megatron's case) each rank applies it to its own tokens.

Source: Megatron-LM ``moe_utils.get_capacity`` / ``topk_routing_with_score_function`` (capacity,
drop policies, padding to capacity); GShard / Switch Transformer (the capacity factor).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..errors import ShardkitError, ShardkitTypeError

__all__ = ["DROP_POLICIES", "CapacityRouting", "expert_capacity", "apply_capacity", "check_capacity_args"]

DROP_POLICIES = ("probs", "position")


class CapacityRouting(NamedTuple):
    """The routing after the capacity rule.

    ``topk_index``/``topk_weights``/``keep`` are ``[T, k]`` (the input routing and which pairs are kept)
    or, with ``pad_to_capacity``, ``[T, E]`` (column ``e`` is expert ``e``; kept and filler
    pairs are marked, fillers and unrouted pairs have weight 0). ``capacity`` is ``C``.
    """

    topk_index: torch.Tensor
    topk_weights: torch.Tensor
    keep: torch.Tensor
    capacity: int


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(T * k / E * f)``: the most (token, slot) pairs one expert takes (Megatron's ``get_capacity``)."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def check_capacity_args(capacity_factor, drop_policy, pad_to_capacity, op: str) -> None:
    """Raise the same error on every rank for bad capacity arguments (pure function of the arguments).

    Raises:
        ShardkitTypeError: non-numeric ``capacity_factor``; non-bool ``pad_to_capacity``.
        ShardkitError: ``capacity_factor <= 0``; unknown ``drop_policy``; ``pad_to_capacity``
            without a capacity factor.
    """
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise ShardkitTypeError(f"{op}: capacity_factor must be a number or None, got {capacity_factor!r}")
        if not capacity_factor > 0 or not math.isfinite(capacity_factor):
            raise ShardkitError(f"{op}: capacity_factor must be > 0 and finite, got {capacity_factor}")
    if drop_policy not in DROP_POLICIES:
        raise ShardkitError(f"{op}: drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    if not isinstance(pad_to_capacity, bool):
        raise ShardkitTypeError(f"{op}: pad_to_capacity must be a bool, got {pad_to_capacity!r}")
    if pad_to_capacity and capacity_factor is None:
        raise ShardkitError(f"{op}: pad_to_capacity needs a capacity_factor (dropless routing has no capacity)")


def apply_capacity(
    topk_index: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    *,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> CapacityRouting:
    """Which (token, slot) pairs each expert keeps under capacity ``C``; on the device, no host sync.

    Args:
        topk_index: ``[T, k]`` global expert ids.
        topk_weights: ``[T, k]`` routing weights (the "probs" of ``drop_policy="probs"``; their
            gradient flows through the returned weights).
        num_experts: ``E``.
        capacity_factor: ``f > 0``.
        drop_policy: ``"probs"`` or ``"position"``.
        pad_to_capacity: fill every expert to ``min(C, T)`` pairs with zero-weight fillers.

    Returns:
        A :class:`CapacityRouting`. Ids outside ``[0, E)`` are left for the dispatcher to report
        on every rank: such a pair is kept; with padding, every returned id is made invalid.

    Raises:
        ShardkitError / ShardkitTypeError: bad arguments (:func:`check_capacity_args`), shapes.
    """
    op = "apply_capacity"
    check_capacity_args(capacity_factor, drop_policy, pad_to_capacity, op)
    if topk_index.dim() != 2 or tuple(topk_weights.shape) != tuple(topk_index.shape):
        raise ShardkitError(
            f"{op}: topk_index and topk_weights must both be [T, k], got "
            f"{tuple(topk_index.shape)} and {tuple(topk_weights.shape)}"
        )
    num_tokens, top_k = topk_index.shape
    cap = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    ids = topk_index.long()
    bad = (ids < 0) | (ids >= num_experts)
    safe = ids.clamp(0, num_experts - 1)
    valid = (~bad).long()
    # [T, E] routing map and weights (scatter_add: a clamped bad id may share a column; it adds 0)
    routed = torch.zeros(num_tokens, num_experts, dtype=torch.long, device=ids.device).scatter_add(1, safe, valid) > 0
    dense = torch.zeros(num_tokens, num_experts, dtype=topk_weights.dtype, device=ids.device)
    dense = dense.scatter_add(1, safe, topk_weights * valid.to(topk_weights.dtype))
    # priority per expert column: routed pairs first (by weight or by position), then the rest;
    # a stable descending sort breaks ties by token order
    if drop_policy == "probs":
        key = torch.where(routed, dense.detach().double(), -math.inf)
    else:
        key = routed.double()
    order = torch.argsort(key, dim=0, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(
        0, order, torch.arange(num_tokens, device=ids.device)[:, None].expand(num_tokens, num_experts)
    )
    chosen = ranks < cap
    if not pad_to_capacity:
        keep = (chosen & routed).gather(1, safe) | bad
        return CapacityRouting(topk_index, topk_weights, keep, cap)
    columns = torch.arange(num_experts, device=ids.device).expand(num_tokens, num_experts)
    columns = columns + bad.any().long() * num_experts  # a bad id anywhere: every id invalid, the dispatcher raises
    return CapacityRouting(columns, dense * (chosen & routed).to(dense.dtype), chosen, cap)
