"""Expert parallelism for Hugging Face MoE experts modules (the ``grouped_gemm``, EP-dispatch and
``ep_router`` plan styles; the ``moe_identity_expert`` input scaling is
:func:`shardkit.tensor_parallel.moe.identity_expert_parallel`, re-exported here).

A transformers experts module is called as ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`` with 3-D parameters ``gate_up_proj [E, 2I, H]`` /
``down_proj [E, H, I]`` (see :mod:`.experts`). Sharding keeps rank r's contiguous block of
experts (``expert_sizes``, the balanced split of ``E`` by default: ``E`` need not divide by
``R``, and a rank may hold none) and replaces the module's forward with one of two modes:

* ``mode="dispatch"`` (Megatron-LM / torchtitan / HF ``AllToAllEP``): tokens travel to their
  experts' ranks and back with :func:`token_dispatch` / :func:`token_combine`. With
  ``tokens="replicated"`` (every rank holds the same batch, the HF situation) each rank first
  keeps a balanced block of the tokens (``split_forward_gather_backward``) and the outputs are
  all-gathered at the end (``gather_forward_split_backward``), so no token is computed twice.
  ``tokens="sharded"``: each rank's tokens are its own (data-parallel attention + EP).
* ``mode="local"`` (HF ``ep_router`` / ``AllReduceEP``): nothing moves; every rank applies its
  own experts to all (replicated) tokens and ``all_reduce_forward`` sums the partial outputs;
  the gradients of the shared inputs are summed by ``all_reduce_backward``.

Ledger per call (``R > 1``): dispatch+replicated: forward 3 ``all_to_all_single`` + 1 gather,
backward 2 + 1 gather; dispatch+sharded: 3 / 2; local: 1 all-reduce / 1 all-reduce (hidden and
routing weights travel together in one buffer in each case).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._shapes import balanced_split_sizes, check_split_sizes, split_offsets
from ..comm import all_reduce_backward, all_reduce_forward, gather_forward_split_backward, split_forward_gather_backward
from ..comm._group import resolve_group
from ..errors import ShardkitError
from ..sharding import ShardSpec, set_shard_spec
from ..tensor_parallel.moe import identity_expert_parallel
from .capacity import apply_capacity, check_capacity_args
from .dispatch import dispatch_plan, token_combine, token_dispatch
from .experts import expert_param_names, grouped_experts_forward, routed_experts_forward

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = [
    "ExpertShard",
    "expert_shard",
    "shard_expert_param",
    "shard_expert_params",
    "install_ep_forward",
    "shard_experts",
    "ep_experts_forward",
    "identity_expert_parallel",
]

MODES = ("dispatch", "local")
TOKENS = ("replicated", "sharded")


@dataclass(frozen=True)
class ExpertShard:
    """How an expert parameter was sharded: block ``sizes[r]`` of dim ``dim`` on rank r of ``group``.

    Attributes:
        dim: the sharded dim (always 0, the experts dim).
        sizes: experts per rank (contiguous blocks in rank order).
        group: the group passed by the caller (``ProcessGroup`` or 1-D ``DeviceMesh``).
        num_experts: global number of experts ``E``.
    """

    dim: int
    sizes: tuple[int, ...]
    group: Group
    num_experts: int


_EP_ATTR = "_shardkit_ep"  # where a sharded parameter (and its experts module) keep their ExpertShard


def expert_shard(t: torch.Tensor | nn.Module) -> ExpertShard | None:
    """The :class:`ExpertShard` recorded on a parameter or experts module, or None."""
    return getattr(t, _EP_ATTR, None)


def _module_shard(module: nn.Module, group, expert_sizes, op: str) -> ExpertShard:
    """The module's sharding, created on first use (later params reuse it: num_experts is local by then)."""
    shard = expert_shard(module)
    if shard is not None:
        return shard
    g = resolve_group(group, op)
    n = getattr(module, "num_experts", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ShardkitError(f"{op}: {type(module).__name__} needs an int num_experts >= 1, got {n!r}")
    shard = ExpertShard(0, tuple(check_split_sizes(expert_sizes, g.size, n, op)), group, n)
    setattr(module, _EP_ATTR, shard)
    return shard


def shard_expert_param(
    module: nn.Module, name: str, group: Group, *, expert_sizes: Sequence[int] | None = None
) -> nn.Parameter:
    """The ``grouped_gemm`` style for one parameter: keep this rank's experts (dim 0).

    Replaces ``module.<name>`` ``[E, ...]`` by a new Parameter ``[E_r, ...]`` (a copy of the
    block), records ``param._shardkit_ep`` (:class:`ExpertShard`) and sets
    ``module.num_experts = E_r`` and ``module._is_expert_parallel = True`` (what HF's experts
    forwards read). Calling it for each expert parameter of a module, in any order, is fine.

    Args:
        module: a transformers experts module (``num_experts`` attribute).
        name: a parameter of ``module`` with leading dim ``E``.
        group: ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the EP group).
        expert_sizes: experts per rank; None for the balanced split of ``E``.

    Raises:
        ShardkitError: no such parameter, its dim 0 is not ``E``, bad ``expert_sizes``.
    """
    op = "shard_expert_param"
    shard = _module_shard(module, group, expert_sizes, op)
    p = module._parameters.get(name)
    if p is None:
        raise ShardkitError(f"{op}: {type(module).__name__} has no parameter {name!r}")
    if expert_shard(p) is not None:
        return p
    if p.dim() < 1 or p.shape[0] != shard.num_experts:
        raise ShardkitError(
            f"{op}: {name} has shape {tuple(p.shape)}, expected leading dim {shard.num_experts} (experts)"
        )
    r = resolve_group(group, op).rank
    block = p.detach()[split_offsets(shard.sizes)[r] : split_offsets(shard.sizes)[r] + shard.sizes[r]].clone()
    new = nn.Parameter(block, requires_grad=p.requires_grad)
    setattr(new, _EP_ATTR, shard)
    # The tensor-parallel spec too, so gather_full_state_dict and the checkpoint code see it.
    set_shard_spec(new, ShardSpec.blocks(0, shard.sizes, group))
    module._parameters[name] = new
    # plain attributes HF's experts forward reads (setattr: nn.Module's typing expects submodules)
    setattr(module, "num_experts", shard.sizes[r])
    setattr(module, "_is_expert_parallel", True)
    return new


def shard_expert_params(module: nn.Module, group: Group, *, expert_sizes: Sequence[int] | None = None) -> list[str]:
    """:func:`shard_expert_param` on every own parameter whose leading dim is ``E``; their names."""
    shard = expert_shard(module)
    names = (
        expert_param_names(module)
        if shard is None
        else [
            n
            for n, p in module.named_parameters(recurse=False)
            if expert_shard(p) is None and p.shape[:1] == (shard.num_experts,)
        ]
    )
    for name in names:
        shard_expert_param(module, name, group, expert_sizes=expert_sizes)
    return names


def _check_mode(mode, tokens, op):
    if mode not in MODES:
        raise ShardkitError(f"{op}: mode must be one of {MODES}, got {mode!r}")
    if tokens not in TOKENS:
        raise ShardkitError(f"{op}: tokens must be one of {TOKENS}, got {tokens!r}")
    if mode == "local" and tokens != "replicated":
        raise ShardkitError(f"{op}: mode='local' needs the same tokens on every rank (tokens='replicated')")


def ep_experts_forward(
    module: nn.Module,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    group: Group,
    *,
    mode: str = "dispatch",
    tokens: str = "replicated",
    token_group: Group | None = None,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> torch.Tensor:
    """Forward of an expert-sharded experts module (the body :func:`install_ep_forward` installs).

    Args:
        module: experts module whose parameters were sharded by :func:`shard_expert_param`.
        hidden: ``[T, H]``; ``top_k_index``: ``[T, k]`` global expert ids; ``top_k_weights``: ``[T, k]``.
        group: the EP group the parameters were sharded over.
        mode: see the module docstring.
        tokens: see the module docstring.
        token_group: with ``tokens="replicated"``, the group the tokens are replicated over
            (default ``group``). Expert parallelism composed with tensor parallelism borrows
            ranks beyond tp (``ep`` spans ``dp_shard x cp x tp``): the tokens are then the same
            on the tp ranks only, so each tp rank keeps its block of them (split over
            ``token_group``) and dispatches it over ``group`` as its own.
        capacity_factor: None (dropless, the default) or Megatron's expert capacity factor
            ``f``: each expert keeps at most ``ceil(T * k / E * f)`` pairs of the ``T`` tokens
            routed in this call (all of them with replicated tokens, so the result equals one
            process; this rank's own with sharded tokens); see :mod:`.capacity`.
        drop_policy: ``"probs"`` (keep the highest weights) or ``"position"`` (the earliest).
        pad_to_capacity: fill every expert to the capacity with zero-weight pairs (fixed
            shapes; same output and gradients).

    Returns:
        ``[T, H]`` in ``hidden``'s dtype: ``sum_j w[t, j] * expert_{idx[t, j]}(hidden[t])``.

    Raises:
        ShardkitError: bad mode / tokens, module not sharded, bad shapes or expert ids.
    """
    op = "ep_experts_forward"
    _check_mode(mode, tokens, op)
    check_capacity_args(capacity_factor, drop_policy, pad_to_capacity, op)
    shard = expert_shard(module)
    if shard is None:
        raise ShardkitError(f"{op}: shard the expert parameters first (shard_expert_param / shard_expert_params)")
    g = resolve_group(group, op)
    if (
        hidden.dim() != 2
        or tuple(top_k_index.shape) != tuple(top_k_weights.shape)
        or top_k_index.shape[:1] != hidden.shape[:1]
    ):
        raise ShardkitError(
            f"{op}: expected hidden [T, H] and top_k [T, k], got {tuple(hidden.shape)}, "
            f"{tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    T, H = hidden.shape
    keep = None
    if capacity_factor is not None:  # on the tokens routed in this call, before any split
        top_k_index, top_k_weights, keep, _ = apply_capacity(
            top_k_index,
            top_k_weights,
            shard.num_experts,
            capacity_factor,
            drop_policy=drop_policy,
            pad_to_capacity=pad_to_capacity,
        )
    # Hidden and weights travel in one buffer so that each boundary costs one collective.
    packed = torch.cat([hidden, top_k_weights.to(hidden.dtype)], dim=1)
    offset = split_offsets(shard.sizes)[g.rank]
    if mode == "local":
        packed = all_reduce_backward(packed, group)
        out = routed_experts_forward(
            module, packed[:, :H], top_k_index, packed[:, H:], offset, keep, num_experts=shard.num_experts
        )
        return all_reduce_forward(out, group).to(hidden.dtype)
    tg = g if token_group is None else resolve_group(token_group, op)
    split_group = group if token_group is None else token_group
    split = tokens == "replicated" and tg.size > 1
    if split:
        sizes = balanced_split_sizes(T, tg.size)
        packed = split_forward_gather_backward(packed, split_group, 0, sizes)
        top_k_index = top_k_index.narrow(0, split_offsets(sizes)[tg.rank], sizes[tg.rank])
        keep = None if keep is None else keep.narrow(0, split_offsets(sizes)[tg.rank], sizes[tg.rank])
    plan = dispatch_plan(top_k_index, shard.num_experts, group, expert_sizes=list(shard.sizes), keep=keep)
    x, counts = token_dispatch(packed[:, :H], plan)
    y = grouped_experts_forward(module, x, counts, H, device_counts=plan.local_counts)
    out = token_combine(y, plan, packed[:, H:])
    if split:
        out = gather_forward_split_backward(out, split_group, 0, sizes)
    return out.to(hidden.dtype)


def install_ep_forward(
    module: nn.Module,
    group: Group,
    *,
    mode: str = "dispatch",
    tokens: str = "replicated",
    token_group: Group | None = None,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> nn.Module:
    """The EP-dispatch / ``ep_router`` style: replace ``module.forward`` by :func:`ep_experts_forward`
    (``token_group`` and the capacity arguments: see there).

    Raises:
        ShardkitError: bad ``mode`` / ``tokens``; the parameters are not sharded yet.
    """
    op = "install_ep_forward"
    _check_mode(mode, tokens, op)
    check_capacity_args(capacity_factor, drop_policy, pad_to_capacity, op)
    if expert_shard(module) is None:
        raise ShardkitError(f"{op}: shard the expert parameters first (shard_expert_param / shard_expert_params)")
    resolve_group(group, op)
    if token_group is not None:
        resolve_group(token_group, op)

    def forward(hidden_states, top_k_index, top_k_weights):
        return ep_experts_forward(
            module,
            hidden_states,
            top_k_index,
            top_k_weights,
            group,
            mode=mode,
            tokens=tokens,
            token_group=token_group,
            capacity_factor=capacity_factor,
            drop_policy=drop_policy,
            pad_to_capacity=pad_to_capacity,
        )

    module.forward = forward
    return module


def shard_experts(
    module: nn.Module,
    group: Group,
    *,
    mode: str = "dispatch",
    tokens: str = "replicated",
    expert_sizes: Sequence[int] | None = None,
    token_group: Group | None = None,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> nn.Module:
    """Shard an experts module over ``group`` (:func:`shard_expert_params`) and install its EP forward.

    Args:
        module: a transformers experts module, e.g. ``model.model.layers[i].mlp.experts``.
        group: ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        mode: ``"dispatch"`` (all-to-all) or ``"local"`` (all-reduce, HF ``ep_router``).
        tokens: ``"replicated"`` (same batch on every rank) or ``"sharded"`` (own tokens).
        expert_sizes: experts per rank; None for the balanced split.
        token_group: the group the tokens are replicated over, when not ``group`` (see
            :func:`ep_experts_forward`).
        capacity_factor: expert capacity (Megatron-LM's); None is dropless (see :func:`ep_experts_forward`).
        drop_policy: ``"probs"`` or ``"position"`` (see :func:`ep_experts_forward`).
        pad_to_capacity: fill every expert to the capacity (see :func:`ep_experts_forward`).

    Returns:
        ``module``, modified in place.

    Raises:
        ShardkitError: as :func:`shard_expert_param` and :func:`install_ep_forward`.

    Source: Hugging Face transformers ``grouped_gemm`` + ``ep_dispatch_experts`` / ``ep_router``
    styles; Megatron-LM all-to-all token dispatcher.
    """
    _check_mode(mode, tokens, "shard_experts")
    check_capacity_args(capacity_factor, drop_policy, pad_to_capacity, "shard_experts")
    if not expert_param_names(module) and expert_shard(module) is None:
        raise ShardkitError(f"shard_experts: {type(module).__name__} has no parameters with leading dim num_experts")
    shard_expert_params(module, group, expert_sizes=expert_sizes)
    return install_ep_forward(
        module,
        group,
        mode=mode,
        tokens=tokens,
        token_group=token_group,
        capacity_factor=capacity_factor,
        drop_policy=drop_policy,
        pad_to_capacity=pad_to_capacity,
    )
