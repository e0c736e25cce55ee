"""Token dispatch and combine for expert parallelism: uneven all-to-alls with exact backward.

The Megatron-LM ``MoEAlltoAllTokenDispatcher`` / torchtitan design. Experts live on ranks in
contiguous blocks (rank r owns global experts ``[offset_r, offset_r + E_r)``, ``E_r`` from
``expert_sizes``, the balanced split of ``E`` by default, so ``E`` need not divide by ``R``).

1. :func:`dispatch_plan` counts each rank's (token, slot) pairs per global expert and exchanges
   the counts with ONE small ``all_to_all_single`` (``R x (E_max + 1)`` int64; the extra column
   carries an "invalid expert id" flag so that bad routing raises on every rank, not one).
2. :func:`token_dispatch` sorts the pairs by global expert id, which groups them by owning rank
   and, within it, by local expert, and moves the rows with ONE uneven ``all_to_all_single``.
   The received rows (source-rank major) are regrouped local-expert major, so expert ``l``'s
   rows are one contiguous block of ``tokens_per_local_expert[l]`` (what a grouped GEMM wants).
3. :func:`token_combine` undoes the regrouping, sends the rows back with the reverse
   all-to-all, restores (token, slot) order and sums the ``k`` outputs per token weighted by
   ``topk_weights``.

Backward: the two row all-to-alls are one autograd Function each whose backward is the reverse
all-to-all (the adjoint); the permutations are plain ``index_select`` (adjoint: scatter-add), so
gradients reach ``hidden``, the expert parameters and ``topk_weights`` exactly. Ledger per MoE
layer: forward 1 count exchange + 1 dispatch + 1 combine ``all_to_all_single``; backward 1 + 1.
A size-1 group communicates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .._shapes import check_split_sizes, split_offsets
from ..comm import _c10d
from ..comm._group import GroupInfo, resolve_group
from ..comm._validate import maybe_agree, placeholder
from ..errors import ShardkitError, ShardkitTypeError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["DispatchPlan", "dispatch_plan", "token_dispatch", "token_combine"]


class _AllToAllRows(torch.autograd.Function):
    """Rows ``[N, H]``: block j (``send[j]`` rows) to rank j; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, g, send, recv, api):
        ctx.g, ctx.send, ctx.recv, ctx.api = g, send, recv, api
        return _exchange(x, g, send, recv, api, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.g, ctx.recv, ctx.send, ctx.api, "backward"), None, None, None, None


def _exchange(x, g, send, recv, api, phase):
    h = x.shape[1]
    flat = _c10d.all_to_all_flat(x.contiguous().view(-1), [s * h for s in send], [r * h for r in recv], g, api, phase)
    return flat.view(sum(recv), h)


@dataclass(eq=False)
class DispatchPlan:
    """Where every (token, slot) pair goes and how many rows each rank and local expert gets.

    Built by :func:`dispatch_plan`; consumed by :func:`token_dispatch` and :func:`token_combine`.
    Sizes are host ints (read back once, by the count exchange); the permutations are tensors on
    the routing tensor's device.

    Attributes:
        group: the resolved expert-parallel group (``R`` ranks).
        num_experts: global number of experts ``E``.
        expert_sizes: experts per rank ``E_r`` (contiguous blocks in rank order).
        num_tokens: local tokens ``T``; ``top_k``: slots ``k`` per token.
        send_sizes: rows sent to each rank (sum ``T * k``).
        recv_sizes: rows received from each rank (sum ``T_recv``).
        recv_counts: ``recv_counts[i][l]``: rows from rank ``i`` for local expert ``l``.
        tokens_per_local_expert: rows per local expert after dispatch (sum ``T_recv``).
        order: ``[T * k]`` sorted position -> flat (token, slot) index (stable sort by expert).
        regroup: ``[T_recv]`` expert-major position -> received position, or None (identity).
        local_counts: ``tokens_per_local_expert`` as a tensor on the device (where it was counted).
        num_dropped: pairs dropped by the ``keep`` mask (capacity): sorted last in ``order``,
            never sent; their combined output is zero.
        dispatched: the ``[T_recv, H]`` rows :func:`token_dispatch` last returned for this plan
            (None before): :func:`token_combine` ties an expert output without graph to them,
            so that a rank that received no rows still joins the backward all-to-alls.
    """

    group: GroupInfo
    num_experts: int
    expert_sizes: tuple[int, ...]
    num_tokens: int
    top_k: int
    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    recv_counts: tuple[tuple[int, ...], ...]
    tokens_per_local_expert: tuple[int, ...]
    order: torch.Tensor
    regroup: torch.Tensor | None
    local_counts: torch.Tensor = field(repr=False, kw_only=True)
    num_dropped: int = field(default=0, kw_only=True)
    dispatched: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.expert_sizes[self.group.rank]

    @property
    def expert_offset(self) -> int:
        """Global id of this rank's first expert."""
        return split_offsets(self.expert_sizes)[self.group.rank]

    def local_expert_ids(self) -> torch.Tensor:
        """``[T_recv]`` local expert id of every dispatched row (expert-major, so non-decreasing)."""
        # the device copy of the counts and the host total: no copy from the host, no read back
        ids = torch.arange(self.local_counts.numel(), device=self.local_counts.device)
        return torch.repeat_interleave(ids, self.local_counts, output_size=sum(self.tokens_per_local_expert))


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor | None:
    """Expert-major order of a source-major buffer of blocks ``counts[src][l]`` (``[R, L]`` on the
    device, ``total`` rows in all, a host int the caller read with the counts).

    Megatron's ``sort_chunks_by_idxs``, built on the device without a host sync: every received
    row gets its local expert id (``repeat_interleave`` of the flattened counts, its output size
    known from the host read, so it does not read the device), and a stable sort by that id
    visits the blocks (l, src) in expert-major order, each block's rows in their received order.
    """
    n_src, n_local = counts.shape
    if n_src <= 1 or n_local <= 1:
        return None  # one source or one local expert: already expert-major
    local = torch.arange(n_local, device=counts.device).repeat(n_src)  # block (src, l) -> l, source-major
    row_expert = torch.repeat_interleave(local, counts.reshape(-1), output_size=total)
    return torch.argsort(row_expert, stable=True)


def _counts_on_device(
    flat: torch.Tensor, num_experts: int, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_expert [E], bad [], order [T k])`` without a host sync; dropped pairs (``keep``
    False) go to an extra last bin, so they sort last and count for no expert.

    ``bincount`` reads the device (its output size depends on the largest id) and an
    out-of-range id would fault a ``scatter`` on an accelerator, so the ids are clamped into
    ``[0, E)`` and counted by ``scatter_add_`` into ``E`` bins; ``bad`` (any id outside) travels
    with the counts to the host in the layer's one read, which raises before the clamped
    routing is used. The stable sort of the clamped ids is the dispatch order.
    """
    bad = ((flat < 0) | (flat >= num_experts)).any()
    ids = flat.clamp(0, num_experts - 1)
    if keep is not None:
        ids = torch.where(keep.reshape(-1), ids, num_experts)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    per_expert.scatter_add_(0, ids, torch.ones_like(ids))
    return per_expert[:num_experts], bad, torch.argsort(ids, stable=True)


def _bad_ids(op: str, num_experts: int, ranks: list[int], size: int) -> ShardkitError:
    return ShardkitError(
        f"{op}: expert ids outside [0, {num_experts}) in topk_index on ranks {ranks} (group of {size})"
    )


def dispatch_plan(
    topk_index: torch.Tensor,
    num_experts: int,
    group: Group,
    *,
    expert_sizes: Sequence[int] | None = None,
    keep: torch.Tensor | None = None,
) -> DispatchPlan:
    """Route (token, slot) pairs to the ranks owning their experts; exchange the counts once.

    One device-to-host read per call (the split sizes of the all-to-alls are host ints, as in
    Megatron-LM and torchtitan): the counts are computed and exchanged on the device and read
    in one ``tolist()`` of one tensor; the sort order and the regrouping index are built on the
    device from them. No tensor is built from host data.

    Args:
        topk_index: ``[T, k]`` integer global expert ids (``T`` may differ by rank, may be 0).
        num_experts: global number of experts ``E`` (same on every rank).
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks (the EP group).
        expert_sizes: experts per rank, contiguous blocks in rank order (zeros allowed); None
            for the balanced split of ``E`` (the first ``E % R`` ranks get one more).
        keep: ``[T, k]`` bool, the pairs to send (None: all); a dropped pair (capacity, see
            :func:`~shardkit.expert_parallel.capacity.apply_capacity`) is not sent and its
            combined output is zero. Ids of dropped pairs are still checked.

    Returns:
        A :class:`DispatchPlan`.

    Raises:
        ShardkitTypeError: ``topk_index`` not an integer tensor; non-int ``num_experts``.
        ShardkitError: ``topk_index`` not 2-D; ``num_experts < 1``; bad ``expert_sizes``; an
            expert id outside ``[0, E)`` on any rank (raised on every rank, after the count
            exchange, naming the offending ranks).

    Source: Megatron-LM ``MoEAlltoAllTokenDispatcher`` (count exchange, sort by expert, uneven
    all-to-all, chunk regrouping); torchtitan's ``generate_permute_indices`` layout.
    """
    op = "dispatch_plan"
    g = resolve_group(group, op)
    error: ShardkitError | None = None  # this rank's own argument error: in check mode every rank raises it
    if (
        not isinstance(topk_index, torch.Tensor)
        or topk_index.is_floating_point()
        or topk_index.is_complex()
        or topk_index.dtype == torch.bool
    ):
        error = ShardkitTypeError(
            f"{op}: topk_index must be an integer tensor, got {getattr(topk_index, 'dtype', type(topk_index).__name__)}"
        )
    elif topk_index.dim() != 2:
        error = ShardkitError(f"{op}: topk_index must be [T, k], got shape {tuple(topk_index.shape)}")
    elif isinstance(num_experts, bool) or not isinstance(num_experts, int):
        error = ShardkitTypeError(f"{op}: num_experts must be an int, got {num_experts!r}")
    elif keep is not None and (
        not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != topk_index.shape
    ):
        error = ShardkitError(
            f"{op}: keep must be a bool tensor of topk_index's shape {tuple(topk_index.shape)}, "
            f"got {getattr(keep, 'dtype', type(keep).__name__)} {tuple(getattr(keep, 'shape', ()))}"
        )
    # check mode: every rank must route over the same experts (E and the split set the counts' layout)
    maybe_agree(
        g, op, topk_index if error is None else placeholder(g), (num_experts, expert_sizes), local_dim=0, error=error
    )
    if num_experts < 1:
        raise ShardkitError(f"{op}: num_experts must be >= 1, got {num_experts}")
    sizes = check_split_sizes(expert_sizes, g.size, num_experts, op)
    num_tokens, top_k = topk_index.shape
    flat = topk_index.reshape(-1).long()
    per_expert, bad, order = _counts_on_device(flat, num_experts, keep)

    if g.size == 1:
        *counts, flagged = torch.cat([per_expert, bad.view(1)]).tolist()  # the one host sync of the layer
        if flagged:
            raise _bad_ids(op, num_experts, [0], 1)
        n = sum(counts)
        return DispatchPlan(
            g,
            num_experts,
            tuple(sizes),
            num_tokens,
            top_k,
            (n,),
            (n,),
            (tuple(counts),),
            tuple(counts),
            order,
            None,
            local_counts=per_expert,
            num_dropped=flat.numel() - n,
        )

    # Counts as [R, E_max + 1]: row j = this rank's counts for rank j's local experts, padded,
    # plus the bad-id flag in every row so that every rank receives every rank's flag. Built
    # from the device counts by split + pad (the experts are contiguous blocks per rank), so no
    # index tensor has to be copied from the host.
    width = max(sizes) + 1
    send = torch.stack([F.pad(c, (0, width - c.numel())) for c in per_expert.split(sizes)])
    send[:, -1] = bad
    recv = _c10d.all_to_all_flat(send.view(-1), [width] * g.size, [width] * g.size, g, op, "forward").view(
        g.size, width
    )
    send_rows, recv_rows = torch.stack([send, recv]).tolist()  # the one host sync of the layer
    flagged = [r for r, row in enumerate(recv_rows) if row[-1]]
    if flagged:
        raise _bad_ids(op, num_experts, flagged, g.size)
    n_local = sizes[g.rank]
    counts = [row[:n_local] for row in recv_rows]
    recv_sizes = tuple(sum(c) for c in counts)
    send_sizes = tuple(sum(row[:-1]) for row in send_rows)
    return DispatchPlan(
        g,
        num_experts,
        tuple(sizes),
        num_tokens,
        top_k,
        send_sizes=send_sizes,
        recv_sizes=recv_sizes,
        recv_counts=tuple(tuple(c) for c in counts),
        tokens_per_local_expert=tuple(sum(c[e] for c in counts) for e in range(n_local)),
        order=order,
        regroup=_regroup_index(recv[:, :n_local], sum(recv_sizes)),
        local_counts=recv[:, :n_local].sum(0),
        num_dropped=flat.numel() - sum(send_sizes),
    )


def _check_plan(plan, op):
    if not isinstance(plan, DispatchPlan):
        raise ShardkitTypeError(f"{op}: plan must be a DispatchPlan (from dispatch_plan), got {type(plan).__name__}")


def _check_rows(x, rows, op, what, plan, topk_weights=None):
    """``x`` must be ``[rows, H]`` (and ``topk_weights`` ``[T, k]``); in check mode an error of one
    rank is raised on every rank, and the ranks agree on ``H`` and the dtype."""
    error: ShardkitError | None = None
    if not isinstance(x, torch.Tensor):
        error = ShardkitTypeError(f"{op}: {what} must be a torch.Tensor, got {type(x).__name__}")
    elif x.dim() != 2 or x.shape[0] != rows:
        error = ShardkitError(f"{op}: {what} must be [{rows}, H] on rank {plan.group.rank}, got {tuple(x.shape)}")
    elif topk_weights is not None and (
        not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (plan.num_tokens, plan.top_k)
    ):
        error = ShardkitError(
            f"{op}: topk_weights must be [{plan.num_tokens}, {plan.top_k}], "
            f"got {getattr(topk_weights, 'shape', topk_weights)}"
        )
    maybe_agree(
        plan.group,
        op,
        x if error is None else placeholder(plan.group),
        (int(topk_weights is not None),),
        local_dim=0,
        error=error,
    )


def token_dispatch(hidden: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int]]:
    """Send every (token, slot) row to its expert's rank; gather-by-reverse-exchange in backward.

    Args:
        hidden: ``[T, H]`` local tokens (``T = plan.num_tokens``).
        plan: from :func:`dispatch_plan` on the same routing.

    Returns:
        ``(expert_input [T_recv, H], tokens_per_local_expert)``: rows grouped by local expert
        (expert ``l``'s rows contiguous, in source-rank then token order).

    Raises:
        ShardkitError: ``hidden`` is not ``[T, H]``. ShardkitTypeError: bad types.
        RankMismatchError: (check mode) ranks disagree on ``H`` or dtype.
    """
    op = "token_dispatch"
    _check_plan(plan, op)
    _check_rows(hidden, plan.num_tokens, op, "hidden", plan)
    order = plan.order[: plan.order.numel() - plan.num_dropped]  # dropped pairs sort last: not sent
    rows = hidden.index_select(0, order // plan.top_k)  # k copies; backward sums them
    if plan.group.size > 1:
        rows = _AllToAllRows.apply(rows, plan.group, plan.send_sizes, plan.recv_sizes, op)
    if plan.regroup is not None:
        rows = rows.index_select(0, plan.regroup)
    plan.dispatched = rows
    return rows, list(plan.tokens_per_local_expert)


def token_combine(
    expert_output: torch.Tensor, plan: DispatchPlan, topk_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Return expert outputs to their tokens and sum the ``k`` slots (weighted); exact backward.

    Args:
        expert_output: ``[T_recv, H']`` in the order :func:`token_dispatch` produced.
        plan: the plan used for the dispatch.
        topk_weights: ``[T, k]`` routing weights (cast to ``expert_output``'s dtype, with
            gradient), or None for an unweighted sum.

    Returns:
        ``[T, H']``: ``out[t] = sum_j topk_weights[t, j] * expert_output_row(t, j)``.

    Raises:
        ShardkitError: wrong shapes. ShardkitTypeError: bad types.

    Every rank must back-propagate through the result (the backward all-to-alls are
    collective). A rank that received no rows still joins them: when ``expert_output`` carries
    no graph but the dispatched rows do, it is tied to them by an exact zero (an empty sum).
    """
    op = "token_combine"
    _check_plan(plan, op)
    _check_rows(expert_output, sum(plan.tokens_per_local_expert), op, "expert_output", plan, topk_weights)
    y = expert_output
    anchor = plan.dispatched
    if torch.is_grad_enabled() and not y.requires_grad and anchor is not None and anchor.requires_grad:
        y = y + anchor[:0].sum().to(y.dtype)  # zero, but keeps this rank in the backward exchanges
    if plan.regroup is not None:
        y = y.index_select(0, _inverse(plan.regroup))
    if plan.group.size > 1:
        y = _AllToAllRows.apply(y, plan.group, plan.recv_sizes, plan.send_sizes, op)
    if plan.num_dropped:  # dropped pairs (sorted last) contribute exact zeros
        y = torch.cat([y, y.new_zeros(plan.num_dropped, y.shape[1])])
    y = y.index_select(0, _inverse(plan.order)).view(plan.num_tokens, plan.top_k, y.shape[1])
    if topk_weights is None:
        return y.sum(1)
    return (y * topk_weights.to(y.dtype).unsqueeze(-1)).sum(1)
