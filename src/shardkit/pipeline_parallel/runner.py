"""Run a pipeline schedule table on a :class:`~.stage.PipelineStage` with shardkit P2P.

Every stage executes :func:`~.schedules.comm_plan` of its row of the table: receives, computes
and sends in order, combined calls where a send and the next action's receive share a
neighbour (the 1F1B steady state). Transfers negotiate shapes, so microbatches may differ in
shape (e.g. sequence length). Gradients are moved explicitly, as in Megatron-LM: ``F`` stores
``(input, output)`` per microbatch, ``B`` calls ``torch.autograd.backward(output, grad)`` and
sends ``input.grad`` back. The loss of each microbatch is scaled by ``1 / M``, so the
accumulated parameter gradients are those of the mean of the microbatch losses (the full-batch
mean for equal-size microbatches of a mean loss), or not (``scale_grads=False``: the sum). An
eval call runs the table's forward-only rows (:mod:`.run_mode`).

Stages made of tp groups (:class:`~.vtp.StageGroups`): every rank of a stage runs the same
plan; transfers go through :class:`~.transport.StageTransport` (layouts reshard across the
boundary, gradients come back with static shapes). The first stage's ranks all take the
inputs, the last stage's all compute the loss (replicated, Megatron's convention: each rank
backpropagates it and the TP regions' reductions make the gradients exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast, overload

import torch

from ..comm import _c10d
from ..comm.agree import agree
from ..data_parallel.microbatches import set_microbatch
from ..errors import ShardkitError
from ._agreed import REJECTED
from ._chunk_exec import run_chunked
from ._links import boundary_decls
from .chunked import ChunkedStage
from .run_mode import TRAIN, ScheduleOutput, resolve_mode, targets_needed
from .run_split import split_microbatches  # re-exported: its home until the runner grew
from .schedules import check_deadlock_free, comm_plan, validate_schedule
from .stage import PipelineStage
from .steps import forward_only, lower
from .tables import schedule_table
from .transport import StageTransport
from .vtp import Replicate

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    from .schedules import Action
    from .steps import Step

__all__ = ["run_schedule", "split_microbatches"]


@overload
def run_schedule(
    stage: PipelineStage | ChunkedStage,
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
    stage: PipelineStage | ChunkedStage,
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
    stage: PipelineStage | ChunkedStage,
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
        stage: this rank's :class:`PipelineStage` (one stage per rank), or its
            :class:`~.chunked.ChunkedStage` (``v`` chunks per rank, virtual stages: the table's
            ``F``/``B``/``I``/``W`` steps run as :mod:`._chunk_exec` says; the first
            (last) stage below is then the rank holding the first (last) chunk).
        schedule: the full table, one row per stage: :class:`~.schedules.Action` s (e.g.
            ``one_f_one_b_schedule(P, M)``) or, for a ``ChunkedStage``, :class:`~.steps.Step` s
            (e.g. ``schedule_table("zbv", P, 2, M)``); or a name of
            :data:`~.tables.SCHEDULES` with ``num_microbatches``.
        inputs_microbatches: first stage: ``M`` input tensors (shapes may differ); else ignored.
        targets_microbatches: last stage: ``M`` targets for ``loss_fn``; else ignored.
        boundary_shapes: None (activations negotiate their shape and dtype: microbatches may
            differ; the stage keeps the negotiated shapes between calls, so a shape seen before
            costs no header round trip; they are dropped on every rank when any rank's previous
            call did not complete, agreed with the arguments), or ``P - 1`` pairs
            ``(full shape, dtype)``, entry ``b`` for the boundary between stages ``b`` and
            ``b + 1`` (the same on every rank and microbatch): static transfers, one message fewer
            each (see :mod:`.p2p` for the check mode).
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
        ShardkitError: on every stage: the table is malformed, has the wrong number of stages
            or cannot run with blocking P2P (pure checks); the first (last) stage was given a
            number of inputs (targets) other than ``M``, or ranks passed different
            ``boundary_shapes``, or modes (``train=True`` under ``torch.no_grad()``, ranks in
            different modes, non-bool flags; agreed by one small all-reduce). A ``ChunkedStage``: a table
            that does not fit ``p`` ranks of ``v`` chunks or cannot run (a dependency out of
            order, a deadlock), ranks passing different tables, ``boundary_shapes`` given, or
            the P2P check mode on.
    """
    op = "run_schedule"
    if not isinstance(stage, ChunkedStage):
        raise ShardkitError(f"{op}: stage must be a PipelineStage or ChunkedStage, got {type(stage).__name__}")
    if stage.stages is None:  # the one chunked runner
        args = (inputs_microbatches, targets_microbatches, stage_kwargs, num_microbatches, boundary_shapes)
        return run_chunked(stage, schedule, *args, op, shape_key, (train, scale_grads, return_outputs))
    # stages of tp groups (StageGroups): the one-chunk tp-group executor below
    assert isinstance(stage, PipelineStage)  # only it is built on StageGroups
    P, s = stage.num_stages, stage.stage_index
    mode, error = resolve_mode(train, scale_grads, return_outputs)
    schedule = _actions(schedule, P, num_microbatches, op)
    if not mode.train:  # eval: the well-formed table's forwards alone, in its order
        validate_schedule(schedule, P, op)
        schedule = forward_only(schedule)
    M = validate_schedule(schedule, P, op, forward_only=not mode.train)
    check_deadlock_free(schedule, op)
    decls = boundary_decls(boundary_shapes, P - 1, op)
    error = error or _data_error(stage, M, inputs_microbatches, targets_microbatches, mode)
    if (
        error is None
        and stage_kwargs is not None
        and (
            not isinstance(stage_kwargs, (list, tuple))
            or len(stage_kwargs) != M
            or not all(isinstance(kw, dict) for kw in stage_kwargs)
        )
    ):
        error = f"stage {s}: stage_kwargs must be None or {M} dicts (one per microbatch)"
    _agree(stage, error, (decls, mode.train), op)
    plan = comm_plan(schedule[s], s, P)
    kwargs = stage_kwargs or [{}] * M
    data = (M, inputs_microbatches, targets_microbatches, decls, kwargs)
    with torch.set_grad_enabled(mode.train):
        out = _execute_tp(stage, plan, *data, mode)
    losses = out[0] if stage.is_last and targets_microbatches is not None else None
    if mode.return_outputs:
        return ScheduleOutput(losses, out[1] if stage.is_last else None)
    return losses


def _actions(schedule, P: int, num_microbatches, op: str) -> Sequence[Sequence[Action]]:
    """A one-stage-per-rank table as ``Action`` s: a name is built for ``v = 1``, a
    :class:`~.steps.Step` table lowered (pure; chunk 0 and ``F``/``B`` steps only)."""
    if isinstance(schedule, str):
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool):
            raise ShardkitError(f"{op}: a schedule name needs num_microbatches= (an int), got {num_microbatches!r}")
        schedule = schedule_table(schedule, P, 1, num_microbatches)
    if isinstance(schedule, (list, tuple)) and any(
        isinstance(a, tuple) and len(a) == 3 for row in schedule if isinstance(row, (list, tuple)) for a in row
    ):
        return lower(schedule, op)
    return cast("Sequence[Sequence[Action]]", schedule)


def _agree(stage, error, key, op: str) -> None:
    """Raise the same ShardkitError on every rank if any rank has a data error or ranks passed
    different boundary shapes or modes (``key``: ``(decls, train)``).

    One :func:`~shardkit.comm.agree.agree`: a single small all-reduce when every rank is fine
    and passed the same shapes (the usual call); the verdicts are gathered only otherwise."""

    def judge(seen: list) -> list[str]:
        differ = [r for r, (d, _) in enumerate(seen) if d != seen[0][0]]
        if differ:
            return [f"ranks {differ} passed boundary_shapes {seen[differ[0]][0]}, rank 0 passed {seen[0][0]}"]
        differ = [r for r, (_, t) in enumerate(seen) if t != seen[0][1]]
        if differ:  # train=None follows torch.no_grad(): one rank under it beside training ones
            return [f"ranks {differ} run with train={seen[differ[0]][1]}, rank 0 with train={seen[0][1]}"]
        return []

    agree(stage.info, op, error, [repr(key[0]), key[1]], judge=judge, headline=REJECTED)


def _data_error(stage, M, inputs, targets, mode) -> str | None:
    for needed, name, xs in (
        (stage.is_first, "inputs_microbatches", inputs),
        (stage.is_last and targets_needed(mode, targets), "targets_microbatches", targets),
    ):
        if needed and (not isinstance(xs, (list, tuple)) or len(xs) != M):
            got = len(xs) if isinstance(xs, (list, tuple)) else type(xs).__name__
            return f"stage {stage.stage_index} needs {M} {name} (the schedule's M), got {got}"
    if stage.is_first and not all(isinstance(x, torch.Tensor) for x in inputs):
        return f"stage {stage.stage_index}: every input microbatch must be a tensor"
    return None


def _compute(action, stage, M, inputs, targets, received, stash, losses, outputs, grads_out, kwargs, mode) -> None:
    """Run one F or B action; its output (or input gradient) waits in ``outputs`` / ``grads_out``
    (the last stage's output stays there with ``return_outputs``)."""
    kind, m = action
    if kind == "F":
        y = _forward(stage, m, M, inputs, targets, received, stash, losses, kwargs[m], mode)
        if y is not None:
            outputs[m] = y
    else:
        grads_out[m] = _backward(stage, m, M, received, stash)


def _forward(stage, m, M, inputs, targets, received, stash, losses, kwargs, mode):
    """One F: the output to send (None on the last stage, but with ``return_outputs``)."""
    if stage.is_first:
        x = inputs[m]
    else:
        x = received.pop(("F", m)).requires_grad_(mode.train)
    y = out = stage.forward(x, **kwargs)
    if stage.is_last:
        if targets is not None:  # always when training (checked)
            loss = stage.loss(y, targets[m])
            losses[m] = loss.detach()
            y = loss / M if mode.scale_grads else loss  # gradients of the mean, or the sum
        out = out if mode.return_outputs else None
    if mode.train:  # a forward-only call keeps nothing
        stash[m] = (None if stage.is_first else x, y)
    return None if out is None else out.detach()


def _execute_tp(stage, plan, M, inputs, targets, decls, kwargs, mode=TRAIN):
    tr = StageTransport(stage.stages, stage.layouts)
    device = next((p.device for p in stage.module.parameters()), torch.device("cpu"))
    received, stash, grads_out, outputs, losses = {}, {}, {}, {}, [None] * M
    grad_decl = {}  # ("send" | "recv", microbatch) -> (full shape, dtype) of a gradient to move
    dtypes = {}
    s = stage.stage_index

    def done(key, t, shape):
        direction, m = key
        if t is None:  # sent: the gradient of this output comes back with its full shape
            if direction == "F":
                grad_decl[("recv", m)] = (shape, dtypes.pop(m))
            return
        received[key] = t
        if direction == "F":  # the gradient of this input goes back with its full shape
            grad_decl[("send", m)] = (shape, t.dtype)

    for call in plan:
        if call.api == "compute":
            _compute(call.action, stage, M, inputs, targets, received, stash, losses, outputs, grads_out, kwargs, mode)
            continue
        sends, recvs = [], []
        for towards, direction, m in call.sends:
            x = outputs.pop(m) if direction == "F" else grads_out.pop(m)
            decl = (decls[s] if decls else None) if direction == "F" else grad_decl.pop(("send", m))
            sends.append((towards, (direction, m), x, decl))
            if direction == "F":
                dtypes[m] = x.dtype
        for towards, direction, m in call.recvs:
            decl = (decls[s - 1] if decls else None) if direction == "F" else (lambda m=m: grad_decl.pop(("recv", m)))
            recvs.append((towards, (direction, m), decl))
        tr.run(call.api, sends, recvs, device, done)
    return losses, [outputs.get(m) for m in range(M)]


def _backward(stage, m, M, received, stash):
    x, y = stash.pop(m)
    grad = None if stage.is_last else received.pop(("B", m))
    set_microbatch(stage.module, m, M)  # FSDP2 reduces the stage's gradients after the last microbatch only
    if y.requires_grad:  # else nothing upstream to differentiate (no parameters, a first stage)
        torch.autograd.backward(y, grad)
    if stage.is_first:
        return None
    # An output that does not depend on the input still owes the previous stage a gradient.
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    if (
        stage.stages is not None
        and stage.tp_size > 1
        and stage.input_grad == "partial"
        and isinstance(stage.layouts[stage.stage_index][0], Replicate)
    ):
        grad = _c10d.all_reduce(grad, stage.stages.tp, "run_schedule", "backward")  # partial sums -> full
    return grad
