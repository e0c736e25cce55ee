"""Load balancing of MoE routers: DeepSeek-V3's auxiliary-loss-free bias, its sequence-wise balance
loss, and the ST-MoE router z-loss. The trainer uses them through :mod:`.router`.

* Auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): a per-expert bias ``b`` is added
  to the routing scores for the top-k *selection* only (:func:`biased_topk`); the gating
  weights come from the unbiased scores. After each step, outside autograd,
  ``b_i += rate * sign(mean_j load_j - load_i)`` (:func:`update_router_bias_`), where the load
  is counted over every rank that routes tokens for the same experts (:func:`expert_load`
  all-reduces it), so the bias stays identical on every rank.
* Sequence-wise balance loss (DeepSeek-V3, eq. 17-20): per sequence of ``S`` tokens,
  ``alpha * sum_i f_i P_i`` with ``f_i = E / (k S) * #{t: i in topk(t)}`` and ``P_i`` the mean of
  the token-normalized scores ``s_it / sum_j s_jt``; averaged over the sequences.
* Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``coeff * mean_t logsumexp(logits_t)^2``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm import all_reduce_forward
from ..errors import ShardkitError

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["biased_topk", "expert_load", "update_router_bias_", "sequence_balance_loss", "router_z_loss"]


def biased_topk(scores: torch.Tensor, bias: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts by ``scores + bias``; the weights are the unbiased scores of those experts.

    Args:
        scores: ``[T, E]`` routing scores (sigmoid or softmax outputs), with gradient.
        bias: ``[E]`` per-expert bias (no gradient is taken through it), or None.
        k: experts per token.

    Returns:
        ``(topk_weights [T, k], topk_index [T, k])``: gradient reaches ``scores`` only.

    Raises:
        ShardkitError: ``scores`` not 2-D, ``bias`` not ``[E]``, ``k`` outside ``[1, E]``.
    """
    if scores.dim() != 2:
        raise ShardkitError(f"biased_topk: scores must be [T, E], got {tuple(scores.shape)}")
    n_exp = scores.shape[1]
    if bias is not None and tuple(bias.shape) != (n_exp,):
        raise ShardkitError(f"biased_topk: bias must be [{n_exp}], got {tuple(bias.shape)}")
    if not 1 <= k <= n_exp:
        raise ShardkitError(f"biased_topk: k must be in [1, {n_exp}], got {k}")
    select = scores.detach() if bias is None else scores.detach() + bias.detach().to(scores.dtype)
    index = select.topk(k, dim=1).indices
    return scores.gather(1, index), index


def expert_load(topk_index: torch.Tensor, num_experts: int, group: Group | None = None) -> torch.Tensor:
    """``[E]`` float64 count of (token, slot) pairs per expert, summed over ``group`` (None: this rank).

    Ids outside ``[0, E)`` are not counted. One all-reduce when ``group`` has more than one rank.
    """
    ids = topk_index.reshape(-1).long()
    ids = ids[(ids >= 0) & (ids < num_experts)]
    load = torch.zeros(num_experts, dtype=torch.float64, device=ids.device)
    load.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float64))
    if group is None:
        return load
    with torch.no_grad():
        return all_reduce_forward(load, group)


@torch.no_grad()
def update_router_bias_(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's bias step, in place: ``bias += rate * sign(mean(load) - load)``; returns ``bias``.

    Underloaded experts (below the mean) gain ``rate``, overloaded ones lose it, balanced ones
    keep their bias. ``load`` must be the same on every rank (:func:`expert_load` with the group).

    Raises:
        ShardkitError: shapes differ; ``rate`` negative.
    """
    if tuple(bias.shape) != tuple(load.shape):
        raise ShardkitError(f"update_router_bias_: bias {tuple(bias.shape)} and load {tuple(load.shape)} differ")
    if rate < 0:
        raise ShardkitError(f"update_router_bias_: rate must be >= 0, got {rate}")
    step = torch.sign(load.mean() - load).to(bias.dtype) * rate
    return bias.add_(step)


def sequence_balance_loss(scores: torch.Tensor, topk_index: torch.Tensor, coeff: float) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the sequences.

    Args:
        scores: ``[B, S, E]`` routing scores (non-negative), with gradient.
        topk_index: ``[B, S, k]`` selected experts.
        coeff: ``alpha``.

    Returns:
        A scalar: ``coeff * mean_b sum_i f_bi P_bi`` (gradient through ``P`` only; ``f`` is a count).

    Raises:
        ShardkitError: shapes disagree.
    """
    if scores.dim() != 3 or topk_index.dim() != 3 or scores.shape[:2] != topk_index.shape[:2]:
        raise ShardkitError(
            f"sequence_balance_loss: expected scores [B, S, E] and topk_index [B, S, k], got "
            f"{tuple(scores.shape)} and {tuple(topk_index.shape)}"
        )
    n_seq, seq_len, n_exp = scores.shape
    k = topk_index.shape[2]
    hits = torch.zeros(n_seq, n_exp, dtype=scores.dtype, device=scores.device)
    hits.scatter_add_(
        1, topk_index.reshape(n_seq, -1).long(), torch.ones_like(topk_index.reshape(n_seq, -1), dtype=scores.dtype)
    )
    f = hits * (n_exp / (k * seq_len))
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return coeff * (f * p).sum(-1).mean()


def router_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE router z-loss: ``coeff * mean over tokens of logsumexp(logits)^2`` (``logits [..., E]``)."""
    z = torch.logsumexp(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1)
    return coeff * z.pow(2).mean()
