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

from ._grouped_gemm import ExpertGroups, grouped_mm_supported
from .errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["expert_forward", "grouped_experts_forward", "routed_experts_forward"]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ w if transposed else F.linear(x, w)
    return out if b is None else out + b


def _parts(module: nn.Module, op: str) -> tuple[Any, str, bool, bool, bool]:
    """``(experts, first projection name, has_gate, has_bias, transposed)``; checks the parameters.

    Raises:
        ShardkitError: the module has neither ``gate_up_proj`` nor ``up_proj``, or no ``down_proj``.
    """
    has_gate = getattr(module, "has_gate", hasattr(module, "gate_up_proj"))
    first = "gate_up_proj" if has_gate else "up_proj"
    if not hasattr(module, first) or not hasattr(module, "down_proj"):
        raise ShardkitError(
            f"{op}: {type(module).__name__} has no {first}/down_proj 3-D expert parameters "
            "(expected a transformers experts module)"
        )
    experts: Any = module  # a transformers experts module: attributes by convention, checked above
    return experts, first, has_gate, getattr(module, "has_bias", False), getattr(module, "is_transposed", False)


def _activate(experts: Any, h: torch.Tensor, has_gate: bool) -> torch.Tensor:
    """The module's gating on the first projection's output (row-wise, so any grouping of rows)."""
    if not has_gate:
        return experts.act_fn(h)
    if hasattr(experts, "_apply_gate"):
        return experts._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def expert_forward(module: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` (index into the module's own parameters) on rows ``x [N, H]``; unweighted.

    One expert's GEMMs; :func:`grouped_experts_forward` runs all of them at once (and equals a
    loop of this over the experts: the reference of its tests).

    Raises:
        ShardkitError: the module has neither ``gate_up_proj`` nor ``up_proj``, or no ``down_proj``.
    """
    experts, first, has_gate, has_bias, transposed = _parts(module, "expert_forward")
    bias = getattr(experts, first + "_bias")[e] if has_bias else None
    h = _activate(experts, _linear(x, getattr(experts, first)[e], bias, transposed), has_gate)
    bias = experts.down_proj_bias[e] if has_bias else None
    y = _linear(h, experts.down_proj[e], bias, transposed)
    if getattr(experts, "has_post_expert_norm", False):
        y = experts.post_expert_norm(y)
    return y


def grouped_experts_forward(
    module: nn.Module,
    x: torch.Tensor,
    tokens_per_expert: Sequence[int] | torch.Tensor,
    out_dim: int,
    *,
    device_counts: torch.Tensor | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """Rows grouped by expert (``tokens_per_expert[l]`` rows for expert ``l``) -> ``[N, out_dim]``.

    The output of :func:`shardkit.expert_parallel.token_dispatch` feeds this directly. Every
    projection of all local experts is ONE GEMM (:class:`shardkit._grouped_gemm.ExpertGroups`:
    ``torch._grouped_mm`` where this build runs it for the dtype and the strides are 16-byte
    multiples, a zero-padded ``torch.bmm`` otherwise); the gating, biases and norm run once on
    all rows. Equal to a loop of :func:`expert_forward` over the experts (exactly in float64).

    Args:
        module: a transformers experts module (``gate_up_proj`` / ``up_proj``, ``down_proj``).
        x: ``[N, H]`` rows grouped by expert.
        tokens_per_expert: ``[E_local]`` rows per expert (host ints, or a tensor read once).
        out_dim: ``H`` of the output (used when the module holds no experts).
        device_counts: the counts on ``x``'s device when the caller has them (saves a copy).
        path: ``"grouped_mm"`` or ``"bmm"`` to force one (tests, benchmarks); None chooses.

    Raises:
        ShardkitError: not an experts module; ``path`` not one of the two, or ``"grouped_mm"``
            where this build does not run it for the dtype and device.

    Source: Megatron-LM ``GroupedMLP`` / torchtitan grouped experts (``torch._grouped_mm``).
    """
    counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
    if path not in (None, "grouped_mm", "bmm"):
        raise ShardkitError(f"grouped_experts_forward: path must be None, 'grouped_mm' or 'bmm', got {path!r}")
    if not counts:  # no local experts
        return x.new_zeros(x.shape[0], out_dim)
    experts, first, has_gate, has_bias, transposed = _parts(module, "grouped_experts_forward")
    w1, w2 = getattr(experts, first), experts.down_proj
    # the GEMM wants [E, K, M]; HF stores [E, M, K] (F.linear's layout) unless is_transposed
    w1, w2 = (w1, w2) if transposed else (w1.transpose(1, 2), w2.transpose(1, 2))
    if path == "grouped_mm" and not grouped_mm_supported(x.device.type, w1.dtype):
        raise ShardkitError(
            f"grouped_experts_forward: torch._grouped_mm does not run {w1.dtype} on {x.device.type} in this torch build"
        )
    groups = ExpertGroups(
        counts, x.device, w1.dtype, (*w1.shape[1:], *w2.shape[1:]), device_counts=device_counts, path=path
    )
    h = groups.mm(x.to(w1.dtype), w1)
    if has_bias:
        h = groups.add_bias(h, getattr(experts, first + "_bias"))
    h = _activate(experts, h, has_gate)
    y = groups.mm(h, w2)
    if has_bias:
        y = groups.add_bias(y, experts.down_proj_bias)
    if getattr(experts, "has_post_expert_norm", False):
        y = experts.post_expert_norm(y)
    return y.to(x.dtype)


def routed_experts_forward(
    module: nn.Module,
    hidden: torch.Tensor,
    topk_index: torch.Tensor,
    topk_weights: torch.Tensor,
    offset: int,
    keep: torch.Tensor | None = None,
    *,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Weighted contribution of the module's experts (global ids ``offset + e``) to every token.

    ``hidden [T, H]``, ``topk_index``/``topk_weights [T, k]`` -> ``[T, H]``; routes to experts not
    held here contribute nothing (the partial sum of the ``ep_router`` / all-reduce mode, and the
    whole output of tensor-parallel experts, which hold every expert: ``offset = 0``).
    ``keep`` (``[T, k]`` bool, None: all): pairs dropped by an expert capacity contribute nothing.
    ``num_experts``: the global ``E``, the range every id must lie in (None: ``offset + E_local``
    when ``offset`` is 0, the module holds every expert; otherwise only ``id >= 0`` is checked).

    An id outside ``[0, E)`` (a custom router's bug) raises instead of being dropped as "held
    elsewhere": the flag rides in the counts' one read (no extra host sync). Every caller passes
    the same ``topk_index`` on every rank of its group (tensor-parallel experts and the
    ``ep_router`` mode route replicated tokens), so every rank raises the same error.

    Sort-based, with one device-to-host read: the (token, slot) pairs are sorted by local expert
    id (routes to experts held elsewhere go to one last bucket) and counted on the device; the
    counts are read once (``tolist``: the row counts of the experts' matmuls are host ints), and
    the experts run on their contiguous blocks as one grouped GEMM per projection
    (:func:`grouped_experts_forward`). A ``torch.where`` per expert (Hugging Face's eager
    loop) reads the device once per expert, plus once for the experts hit.

    Source: the Megatron-LM / torchtitan permute-by-sort of routed tokens.
    """
    stacked: torch.Tensor = (
        getattr(module, "gate_up_proj") if hasattr(module, "gate_up_proj") else getattr(module, "up_proj")
    )
    n, k = stacked.shape[0], topk_index.shape[1]  # the experts this module holds; slots per token
    if num_experts is None and offset == 0:
        num_experts = n
    ids = topk_index.reshape(-1).long()
    bad = (ids < 0) if num_experts is None else (ids < 0) | (ids >= num_experts)
    local = ids - offset
    held = (local >= 0) & (local < n)
    if keep is not None:
        held = held & keep.reshape(-1)
    # not held here (or dropped): bucket n; an id outside [0, E): bucket n + 1; both sorted last
    bucket = torch.where(bad, n + 1, torch.where(held, local, n))
    counts = torch.zeros(n + 2, dtype=torch.long, device=local.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # no bincount: its output size reads the device
    order = torch.argsort(bucket, stable=True)
    sizes = counts.tolist()  # the one host sync (the bad-id count rides in it)
    if sizes[n + 1]:
        where = f"[0, {num_experts})" if num_experts is not None else "[0, E)"
        seen = ids[bad].unique()[:4].tolist()  # the error path only: a second read is fine here
        raise ShardkitError(
            f"routed_experts_forward: {sizes[n + 1]} expert ids outside {where} in topk_index "
            f"{tuple(topk_index.shape)} (e.g. {seen}); the router must return ids of existing experts"
        )
    pairs = order[: local.numel() - sizes[n]]  # the held (token, slot) pairs, grouped by expert
    token = pairs // k
    y = grouped_experts_forward(
        module, hidden.index_select(0, token), sizes[:n], hidden.shape[1], device_counts=counts[:n]
    )
    w = topk_weights.reshape(-1).index_select(0, pairs)
    out = hidden.new_zeros(hidden.shape[0], hidden.shape[1])
    out = out.index_add(0, token, (y * w[:, None]).to(out.dtype))
    # Tie the output to both inputs even when no route lands here, so that this rank joins the
    # backward all-reduces of the shared inputs (an empty sum is an exact zero).
    return out + (hidden[:0].sum() + topk_weights[:0].sum()).to(out.dtype)
