"""Sequence-parallel activations as Megatron keeps them (``sp_activation="shard"``).

Under sequence parallelism a block's norm runs on this rank's sequence block ``[B, S_r, H]``
and one all-gather makes the ``[B, S, H]`` input of the column-parallel projections (q/k/v,
gate/up, the head). A plain ``nn.Linear`` keeps that gathered input for its weight gradient:
``T x H`` per norm and microbatch, ``tp`` times the shard. With ``sp_activation="shard"`` the
projections run through :class:`_ShardSavedLinear`, which keeps the shard instead and
all-gathers it again in backward (one all-gather per projection group, shared by its readers
through :class:`Regather`; ledger ``api="sp_regather"``, phase ``"recompute"``). Gradients are
the same numbers: the gather is pure data movement and the weight gradient is computed with the
matmuls autograd uses for ``F.linear``.

Activation checkpointing: the checkpoint's recompute gathers the shard again anyway (a real
all-gather: :func:`shardkit.comm.replay_scope.unreplayed` keeps the selective replay from
holding its ``T x H`` result). That gather is published in the model's :class:`RegatherPool`
under the shard's storage, and the readers' backward takes it from there instead of gathering a
second time; without a recompute (``activation_checkpoint="none"``) they gather once themselves.

Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), sec. 4.2.2 (the sequence-parallel all-gather's output is not stored; the shard is, and
is gathered again in backward), as Megatron-LM's column-parallel linear does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import _c10d
from ..comm._group import GroupInfo
from ..comm.split_pass import in_input_pass, will_execute
from ..errors import ShardkitError

__all__ = ["SP_ACTIVATIONS", "Regather", "RegatherPool", "check_sp_activation", "shard_saved_linear"]

SP_ACTIVATIONS = ("shard", "gathered")


def check_sp_activation(value: str, where: str = "parallelize") -> str:
    """``value`` if it is one of :data:`SP_ACTIVATIONS`.

    Raises:
        ShardkitError: any other value, naming ``where``.
    """
    if value not in SP_ACTIVATIONS:
        raise ShardkitError(f"{where}: sp_activation must be 'shard' or 'gathered', got {value!r}")
    return value


def _task() -> int:
    return torch._C._current_graph_task_id()


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


class RegatherPool:
    """Gathers a checkpoint's recompute issued in the running backward, by the shard they
    gathered (module docstring). One per model (:class:`~.sequence.SequenceSharding`); entries
    of another backward are dropped when a new one is published."""

    def __init__(self) -> None:
        self.entries: dict[tuple, Regather] = {}

    def publish(self, shard: torch.Tensor, handle: Regather) -> None:
        task = _task()
        self.entries = {k: h for k, h in self.entries.items() if h.task == task}
        self.entries[_key(shard)] = handle

    def take(self, shard: torch.Tensor, task: int) -> Regather | None:
        if not self.entries:  # no checkpoint recomputed a gather (the common case): no storage lookup
            return None
        h = self.entries.get(_key(shard))
        return h if h is not None and h.task == task and h.full is not None else None


class Regather:
    """One sequence all-gather whose output the projections reading it do not keep.

    Attributes:
        readers: the projections of this forward reading the gathered tensor.
        full: the gathered ``[B, S, H]`` while backward still needs it, else None.
    """

    def __init__(self, g: GroupInfo, dim: int, sizes: list[int], pool: RegatherPool) -> None:
        self.g, self.dim, self.sizes, self.pool = g, dim, sizes, pool
        self.readers, self.left = 0, 0
        self.full: torch.Tensor | None = None
        self.task = -1

    def recomputed(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """The checkpoint's recompute gathered ``shard`` into ``full`` (in backward): publish it."""
        self.full, self.task = full.detach(), _task()
        self.pool.publish(shard, self)

    def add_reader(self) -> None:
        self.readers += 1
        if self.full is not None:  # a recompute's reader: the original node will take it
            self.left += 1

    def full_for_backward(self, shard: torch.Tensor) -> torch.Tensor:
        """The gathered tensor for one reader's backward: the recompute's, this backward's earlier
        regather, or a new all-gather (then shared by the other readers of this backward).

        An earlier regather is shared while readers are left, across autograd passes too: the
        zero-bubble ``W`` runs each reader's weight gradient in a pass of its own
        (:mod:`shardkit.pipeline_parallel.split_backward`), and the shard it gathers is the same
        saved tensor, so the values are too."""
        task = _task()
        h = self.pool.take(shard, task) or self
        if h.full is None or (h.task != task and h.left <= 0):
            h.full = _c10d.all_gather(shard, h.g, h.dim, h.sizes, "sp_regather", "recompute")
            h.task, h.left = task, h.readers
        out = h.full
        h.left -= 1
        if h.left <= 0:
            h.full = None
        return out


class _ShardSavedLinear(torch.autograd.Function):
    """``F.linear(full, weight, bias)`` keeping ``shard`` (not ``full``) for backward."""

    @staticmethod
    def forward(ctx, full, shard, weight, bias, handle):
        ctx.handle, ctx.has_bias = handle, bias is not None
        ctx.save_for_backward(shard, weight)
        handle.add_reader()
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        need_x, _, need_w, need_b, _ = ctx.needs_input_grad
        # under the zero-bubble split, I leaves the weight gradient (and its all-gather) to W,
        # which reruns this node for its weight only and never reads the input gradient
        need_x = need_x and will_execute(ctx.next_functions[0])
        need_w, need_b = (need_w and not in_input_pass()), (need_b and not in_input_pass())
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if need_x:  # the matmuls of F.linear's own backward (bitwise equal in float64, checked)
            gx = g2.mm(weight).view(*grad.shape[:-1], weight.shape[-1])
        if need_w:
            full = ctx.handle.full_for_backward(shard)
            gw = g2.t().mm(full.reshape(-1, full.shape[-1]))
        if need_b and ctx.has_bias:
            gb = g2.sum(0)
        return gx, None, gw, gb, None


def shard_saved_linear(
    full: torch.Tensor, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, handle: Regather
) -> torch.Tensor:
    """``F.linear(full, weight, bias)`` that keeps ``shard`` for backward and gathers it again there.

    Args:
        full: the gathered input ``[B, S, in]`` (``handle``'s all-gather of ``shard``).
        shard: this rank's block ``[B, S_r, in]``.
        weight: ``[out_r, in]``; bias ``[out_r]`` or None.
        handle: the :class:`Regather` of the all-gather that made ``full``.

    Returns:
        ``[B, S, out_r]``, as ``F.linear``; gradients for ``full``, ``weight`` and ``bias``.
    """
    if not (torch.is_grad_enabled() and (full.requires_grad or weight.requires_grad)):
        return F.linear(full, weight, bias)
    return _ShardSavedLinear.apply(full, shard, weight, bias, handle)
