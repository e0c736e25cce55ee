"""Run a pipeline schedule on a stage: the one runner, :mod:`._chunk_exec`, for every stage.

A :class:`~.stage.PipelineStage` (one chunk or ``v`` chunks per rank, or one chunk per tp group
of its own size, :class:`~.vtp.StageGroups`) runs every schedule of :data:`~.tables.SCHEDULES` or a table of
:class:`~.steps.Step` s (one-chunk ``Action`` tables are lifted). Gradients are moved
explicitly, as in Megatron-LM: ``F`` keeps ``(input, output)`` per microbatch, ``B`` calls
``torch.autograd.backward(output, grad)`` and hands ``input.grad`` back (``I``/``W``: the split
of :mod:`.split_backward`). The loss of each microbatch is scaled by ``1 / M``, so the
accumulated parameter gradients are those of the mean of the microbatch losses (the full-batch
mean for equal-size microbatches of a mean loss), or not (``scale_grads=False``: the sum). An
eval call runs the table's forward-only rows (:mod:`.run_mode`).

Stages made of tp groups: every rank of a stage runs the same row; each message is a boundary
reshard between the two stages' layouts (:mod:`._stage_links`). The first stage's ranks all
take the inputs, the last stage's all compute the loss (replicated, Megatron's convention: each
rank backpropagates it and the TP regions' reductions make the gradients exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

import torch

from ..errors import ShardkitError
from ._chunk_exec import run_chunked
from .run_mode import ScheduleOutput
from .stage import PipelineStage

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    from .schedules import Action
    from .steps import Step

__all__ = ["run_schedule", "split_microbatches"]


@overload
def run_schedule(
    stage: PipelineStage,
    schedule: Sequence[Sequence[Action]] | Sequence[Sequence[Step]] | str,
    inputs_microbatches: Sequence[torch.Tensor] | None = None,
    targets_microbatches: Sequence[torch.Tensor] | None = None,
    *,
    boundary_shapes: Sequence[tuple[Sequence[int], torch.dtype]] | None = None,
    stage_kwargs: Sequence[dict] | None = None,
    num_microbatches: int | None = None,
    shape_key: Hashable | None = None,
    train: bool | None = None,
    scale_grads: bool = True,
    return_outputs: Literal[False] = False,
) -> list[torch.Tensor] | None: ...


@overload
def run_schedule(
    stage: PipelineStage,
    schedule: Sequence[Sequence[Action]] | Sequence[Sequence[Step]] | str,
    inputs_microbatches: Sequence[torch.Tensor] | None = None,
    targets_microbatches: Sequence[torch.Tensor] | None = None,
    *,
    boundary_shapes: Sequence[tuple[Sequence[int], torch.dtype]] | None = None,
    stage_kwargs: Sequence[dict] | None = None,
    num_microbatches: int | None = None,
    shape_key: Hashable | None = None,
    train: bool | None = None,
    scale_grads: bool = True,
    return_outputs: Literal[True],
) -> ScheduleOutput: ...


def run_schedule(
    stage: PipelineStage,
    schedule: Sequence[Sequence[Action]] | Sequence[Sequence[Step]] | str,
    inputs_microbatches: Sequence[torch.Tensor] | None = None,
    targets_microbatches: Sequence[torch.Tensor] | None = None,
    *,
    boundary_shapes: Sequence[tuple[Sequence[int], torch.dtype]] | None = None,
    stage_kwargs: Sequence[dict] | None = None,
    num_microbatches: int | None = None,
    shape_key: Hashable | None = None,
    train: bool | None = None,
    scale_grads: bool = True,
    return_outputs: bool = False,
) -> list[torch.Tensor] | ScheduleOutput | None:
    """Run this stage's row of ``schedule`` (forward and backward of every microbatch), or its
    forward-only rows (eval).

    Collective over the pipeline group: every stage calls it with the same table.

    Args:
        stage: this rank's :class:`PipelineStage` (one chunk per rank or per tp group, or ``v``
            chunks per rank: virtual stages); the table's
            ``F``/``B``/``I``/``W`` steps run as :mod:`._chunk_exec` says; the first (last)
            stage below is the rank holding the first (last) chunk.
        schedule: the full table, one row per rank: :class:`~.steps.Step` s (e.g.
            ``schedule_table("zbv", P, 2, M)``) or, one chunk per rank,
            :class:`~.schedules.Action` s (e.g. ``one_f_one_b_schedule(P, M)``); or a name of
            :data:`~.tables.SCHEDULES` with ``num_microbatches``.
        inputs_microbatches: first stage: ``M`` input tensors (shapes may differ); else ignored.
        targets_microbatches: last stage: ``M`` targets for ``loss_fn``; else ignored.
        boundary_shapes: None (activations negotiate their shape and dtype: microbatches may
            differ; the stage keeps the negotiated shapes between calls, so a shape seen before
            costs no header round trip; they are dropped on every rank when any rank's previous
            call did not complete, agreed with the arguments), or ``P v - 1`` pairs
            ``(full shape, dtype)``, entry ``b`` for the boundary between (global) chunks ``b``
            and ``b + 1`` (one chunk per rank: stages; the same on every rank and microbatch;
            a gradient has its activation's): static transfers, one message fewer each
            (:mod:`._links`; in the check mode each still carries a header, judged on both ends).
        stage_kwargs: None, or ``M`` dicts of keyword arguments for this stage's module, one per
            microbatch (``module(x, **stage_kwargs[m])``; every stage, e.g. the global
            ``position_ids`` and attention call of context parallelism).
        num_microbatches: ``M`` when ``schedule`` is a name.
        shape_key: None, or the caller's promise that every message's shape follows from this
            key (the same on every rank of the pipeline group, e.g. the microbatches' input
            shapes of a trainer whose stages map ``[b, S]`` to ``[b, S, H]``). A call repeating
            the key of the stage's previous completed call trusts the shapes that call
            negotiated: no host read of a received header (one per message otherwise, each a
            stall of the host until the message arrived); the headers are still compared, on
            the device, into ``stage.shape_trust`` (:class:`~._transfer.ShapeTrust`), whose
            ``take()`` the caller reads with its own next read and raises on every rank when
            set (a message did not have the agreed shape: its payload was not delivered).
            Ignored in the P2P check mode (every header verified).
        train: True: forwards and backwards; False: the table's forward-only rows
            (:func:`~.steps.forward_only`, every schedule, zero-bubble ones included) under
            ``torch.no_grad``, no gradient message; None (default): ``torch.is_grad_enabled()``.
        scale_grads: True (default): back-propagate ``loss / M`` (gradients of the mean of the
            microbatch losses); False: each ``loss`` (the sum; torch's ``scale_grads=False``,
            DualPipe).
        return_outputs: also return the last stage's outputs (see Returns).

    Returns:
        Last stage (every rank of it): the ``M`` detached, unscaled microbatch losses (None in an
        eval call without targets); other stages: None. With ``return_outputs``, on every rank
        a :class:`~.run_mode.ScheduleOutput` ``(losses, outputs)``: the losses as above and the
        last stage's ``M`` detached outputs (before the loss), both None on other stages.
        Parameter gradients accumulate into ``.grad`` (call ``zero_grad`` between steps).

    Raises:
        ShardkitError: on every rank (agreed by one small all-reduce, once per stage and table
            with checks off, every call with them on): a malformed table, one that does not fit
            ``p`` ranks of ``v`` chunks or cannot run (a dependency out of order, a deadlock:
            pure checks), ranks passing different tables or ``boundary_shapes``, the first
            (last) stage given a number of inputs (targets) other than ``M``, or modes
            (``train=True`` under ``torch.no_grad()``, ranks in different modes, non-bool flags).
    """
    op = "run_schedule"
    if not isinstance(stage, PipelineStage):
        raise ShardkitError(f"{op}: stage must be a PipelineStage, got {type(stage).__name__}")
    args = (inputs_microbatches, targets_microbatches, stage_kwargs, num_microbatches, boundary_shapes)
    return run_chunked(stage, schedule, *args, op, shape_key, (train, scale_grads, return_outputs))


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Split ``[B, ...]`` into ``M`` microbatches ``[B / M, ...]`` along dim 0 (views).

    Raises:
        ShardkitError: ``M`` not an int >= 1, ``batch`` 0-d, or ``M`` does not divide ``B``.
    """
    M = num_microbatches
    if not isinstance(M, int) or isinstance(M, bool) or M < 1:
        raise ShardkitError(f"split_microbatches: num_microbatches must be an int >= 1, got {M!r}")
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        raise ShardkitError("split_microbatches: batch must be a tensor with a batch dimension (dim 0)")
    B = batch.shape[0]
    if B % M:
        raise ShardkitError(
            f"split_microbatches: {M} microbatches do not divide the batch of {B} "
            f"(B % M = {B % M}); pick M dividing {B}"
        )
    return list(batch.split(B // M, dim=0))
