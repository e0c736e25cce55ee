"""Balanced routing for transformers MoE routers: DeepSeek-V3's bias in the top-k selection, the
sequence-wise balance loss and the router z-loss in the gradient, the load counted per step.

:func:`install_balanced_router` replaces a router's forward (``Qwen3MoeTopKRouter``:
softmax, top-k, ``norm_topk_prob``; ``DeepseekV2TopkRouter``: float32 softmax, greedy top-k,
``routed_scaling_factor``) by the same math with:

* the selection by ``scores + bias`` (:func:`.balance.biased_topk`; the bias is the router's
  buffer ``e_score_correction_bias`` ``[E]`` float32, DeepSeek-V3's name, so it is saved with the
  training state), the gating weights from the unbiased scores;
* the auxiliary losses added to the objective without touching the model's output: the routing
  weights pass through :class:`AuxLossGrad`, the identity in forward whose backward gives the
  loss gradient 1 (Megatron-LM's ``MoEAuxLossAutoScaler`` technique), so the losses reach the
  router under any schedule, pipeline or activation checkpointing. Each call adds its share of
  a global mean: ``z_loss * sum_t lse_t^2 * token_scale`` and
  ``seq_aux_loss * sum_b (f_b . P_b) * seq_scale`` (``token_scale`` = 1 / tokens routed per
  step, ``seq_scale`` = 1 / sequences per step: the caller's global counts);
* the load: per-expert (token, slot) counts accumulated in :attr:`BalanceState.load` by each
  forward that runs with gradient outside a backward (an activation-checkpoint recompute runs
  inside the backward and is not counted twice; evaluation under ``no_grad`` is not counted).
* optionally the expert capacity (Megatron-LM's capacity factor) on each call's tokens, or on
  each token group of a call (:mod:`.router_capacity`): dropped pairs get weight 0, counted
  in :attr:`BalanceState.dropped` like the load.

The caller all-reduces the load over the ranks routing different tokens and then steps the bias
(:func:`.balance.update_router_bias_`); :mod:`shardkit.train.moe_balance` does it for the trainer.

Source: DeepSeek-V3 (arXiv 2412.19437, section 2.1.2, eq. 16-20), ST-MoE (z-loss), Megatron-LM's
``moe_router_enable_expert_bias`` / ``MoEAuxLossAutoScaler`` (the gradient-injection technique).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm._compat import current_autograd_node
from ..errors import ShardkitError
from .balance import biased_topk, sequence_balance_loss
from .capacity import check_capacity_args
from .router_capacity import grouped_capacity_keep

__all__ = ["AuxLossGrad", "BalanceState", "install_balanced_router", "balance_state", "BIAS_BUFFER"]

BIAS_BUFFER = "e_score_correction_bias"
_ATTR = "_shardkit_balance"


class AuxLossGrad(torch.autograd.Function):
    """Identity on ``x`` in forward; in backward ``aux`` (a 0-d loss) gets gradient 1, so its
    gradient joins the model's as if ``aux`` were added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.dtype, aux.device)
        return x.clone()  # a new tensor: the caller may modify it in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.aux_meta
        return grad, torch.ones((), dtype=dtype, device=device)


@dataclass
class BalanceState:
    """One router's balancing options and this step's accumulators (float64, on the router's device).

    Attributes:
        bias_rate: DeepSeek-V3's update rate ``gamma`` (None: no bias, plain top-k).
        z_loss: the router z-loss coefficient (0: off).
        seq_aux_loss: the sequence-wise balance loss coefficient (0: off).
        token_scale: 1 / tokens of the global step.
        seq_scale: 1 / sequences of the global step.
        seq_len: tokens per sequence in the router's input (the sequence-wise loss cuts ``T`` by it).
        load: ``[E]`` (token, slot) pairs routed to each expert since the last :meth:`reset`.
        aux: ``[2]`` this rank's share of the z-loss and of the sequence loss since then.
        capacity_factor: expert capacity per token group (None: dropless; :mod:`.router_capacity`).
        drop_policy: ``"probs"`` or ``"position"``.
        capacity_groups: ``T -> groups`` of a call's ``T`` tokens (None: the call is one group).
        dropped: ``[1]`` (token, slot) pairs dropped since the last :meth:`reset`.
    """

    bias_rate: float | None
    z_loss: float
    seq_aux_loss: float
    token_scale: float
    seq_scale: float
    seq_len: int
    load: torch.Tensor
    aux: torch.Tensor
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    capacity_groups: Callable[[int], Sequence[torch.Tensor]] | None = None
    dropped: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.float64))

    def reset(self) -> None:
        self.load.zero_()
        self.aux.zero_()
        self.dropped.zero_()


def balance_state(router: nn.Module) -> BalanceState | None:
    """The :class:`BalanceState` of a router :func:`install_balanced_router` changed, else None."""
    return getattr(router, _ATTR, None)


def _kind(router: nn.Module) -> str:
    if hasattr(router, "routed_scaling_factor"):  # DeepseekV2TopkRouter
        if getattr(router, "topk_method", "greedy") != "greedy" and getattr(router, "num_group", 1) != 1:
            raise ShardkitError(
                f"install_balanced_router: {type(router).__name__} with topk_method={router.topk_method!r} and "
                f"{router.num_group} groups: only greedy top-k (or one group) is supported"
            )
        return "deepseek"
    if hasattr(router, "norm_topk_prob"):  # Qwen3MoeTopKRouter and its copies
        return "qwen"
    raise ShardkitError(
        f"install_balanced_router: {type(router).__name__} is not a known transformers top-k router "
        "(Qwen3MoeTopKRouter, DeepseekV2TopkRouter)"
    )


def install_balanced_router(
    router: nn.Module,
    *,
    bias_rate: float | None = None,
    z_loss: float = 0.0,
    seq_aux_loss: float = 0.0,
    token_scale: float = 1.0,
    seq_scale: float = 1.0,
    seq_len: int = 1,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    capacity_groups: Callable[[int], Sequence[torch.Tensor]] | None = None,
) -> BalanceState:
    """Replace ``router.forward`` by the balanced one (module docstring); returns its state.

    Args:
        router: a transformers top-k router (``weight [E, H]``, ``top_k``, ``num_experts``).
        bias_rate: ``gamma >= 0`` of the bias update (None: no bias buffer, plain top-k).
        z_loss: ST-MoE z-loss coefficient (>= 0).
        seq_aux_loss: DeepSeek-V3 sequence-wise loss coefficient ``alpha`` (>= 0).
        token_scale: 1 / tokens routed per global step (the z-loss is a mean over them).
        seq_scale: 1 / sequences per global step (the sequence loss is a mean over them).
        seq_len: tokens per sequence in each call (``T`` must be a multiple when ``seq_aux_loss``).
        capacity_factor: Megatron-LM's expert capacity factor, applied to each call's tokens (or
            to each of ``capacity_groups(T)``): dropped pairs get weight 0 (None: dropless).
        drop_policy: ``"probs"`` or ``"position"`` (:mod:`.capacity`).
        capacity_groups: maps a call's token count ``T`` to its token groups
            (:func:`.router_capacity.grouped_capacity_keep`); None: the call is one group.

    Raises:
        ShardkitError: an unknown router; a negative rate or coefficient; ``seq_len < 1``; bad
            capacity arguments.
    """
    kind = _kind(router)
    mod: Any = router  # a transformers router: its plain attributes (top_k, num_experts) are no tensors
    for name, value in (("bias_rate", bias_rate or 0.0), ("z_loss", z_loss), ("seq_aux_loss", seq_aux_loss)):
        if not value >= 0:
            raise ShardkitError(f"install_balanced_router: {name} must be >= 0, got {value}")
    if seq_len < 1:
        raise ShardkitError(f"install_balanced_router: seq_len must be >= 1, got {seq_len}")
    check_capacity_args(capacity_factor, drop_policy, False, "install_balanced_router")
    weight: torch.Tensor = mod.weight
    n_exp = int(mod.num_experts)
    if bias_rate is not None and BIAS_BUFFER not in router._buffers:
        router.register_buffer(BIAS_BUFFER, torch.zeros(n_exp, dtype=torch.float32, device=weight.device))
    state = BalanceState(
        bias_rate,
        z_loss,
        seq_aux_loss,
        token_scale,
        seq_scale,
        seq_len,
        torch.zeros(n_exp, dtype=torch.float64, device=weight.device),
        torch.zeros(2, dtype=torch.float64, device=weight.device),
        capacity_factor,
        drop_policy,
        capacity_groups,
        torch.zeros(1, dtype=torch.float64, device=weight.device),
    )
    setattr(router, _ATTR, state)

    def forward(hidden_states: torch.Tensor):
        return _balanced_forward(router, kind, hidden_states)

    router.forward = forward
    return state


def _balanced_forward(router: Any, kind: str, hidden_states: torch.Tensor):
    """``(router_logits [T, E], weights [T, k], index [T, k])`` as the router's own forward returns."""
    state = balance_state(router)
    assert state is not None
    h = hidden_states.reshape(-1, router.hidden_dim)
    # transformers' routers compute (DeepSeek-V2: the logits too) in float32; float64 stays float64
    # (shardkit.train.model.keep_float64's rule: a float64 --verify measures the layout, not rounding)
    weight: torch.Tensor = router.weight
    wide = torch.promote_types(weight.dtype, torch.float32)
    if kind == "deepseek":
        logits = F.linear(h.to(wide), weight.to(wide))
    else:
        logits = F.linear(h, weight)
    scores = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    bias = router._buffers.get(BIAS_BUFFER) if state.bias_rate is not None else None
    weights, index = biased_topk(scores, bias, int(router.top_k))
    if kind == "deepseek":
        weights = weights * router.routed_scaling_factor
    else:
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
    training = torch.is_grad_enabled()
    first_pass = training and current_autograd_node() is None  # not a checkpoint's recompute
    if first_pass:
        state.load.add_(torch.bincount(index.reshape(-1), minlength=state.load.numel()).to(state.load.dtype))
    if state.capacity_factor is not None:  # the load above counts routed pairs, dropped or not
        groups = state.capacity_groups(index.shape[0]) if state.capacity_groups is not None else None
        keep = grouped_capacity_keep(
            index, weights, state.load.numel(), state.capacity_factor, drop_policy=state.drop_policy, groups=groups
        )
        weights = weights * keep.to(weights.dtype)  # zero output, zero weight gradient: dropped
        if first_pass:
            state.dropped.add_((~keep).sum().to(state.dropped.dtype))
    if not training or not (state.z_loss or state.seq_aux_loss):
        return logits, weights, index
    parts = []
    if state.z_loss:
        z = torch.logsumexp(logits.to(scores.dtype), dim=-1).pow(2).sum() * (state.z_loss * state.token_scale)
        parts.append(z)
    else:
        parts.append(scores.new_zeros(()))
    if state.seq_aux_loss:
        n_tok, n_exp = scores.shape
        if n_tok % state.seq_len:
            raise ShardkitError(
                f"balanced router: {n_tok} tokens are not whole sequences of {state.seq_len} "
                "(the sequence-wise balance loss needs each sequence whole on one rank)"
            )
        n_seq = n_tok // state.seq_len
        seq = sequence_balance_loss(
            scores.view(n_seq, state.seq_len, n_exp), index.view(n_seq, state.seq_len, -1), state.seq_aux_loss
        )
        parts.append(seq * (n_seq * state.seq_scale))
    else:
        parts.append(scores.new_zeros(()))
    aux = torch.stack([p.to(scores.dtype) for p in parts])  # float32, or float64 for a float64 model
    if first_pass:
        state.aux.add_(aux.detach().to(state.aux.dtype))
    return logits, AuxLossGrad.apply(weights, aux.sum()), index
