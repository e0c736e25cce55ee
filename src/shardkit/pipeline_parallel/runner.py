"""Run a pipeline schedule table on a :class:`~.stage.PipelineStage` with shardkit P2P.

Every stage executes :func:`~.schedules.comm_plan` of its row of the table: receives, computes
and sends in order, combined calls where a send and the next action's receive share a
neighbour (the 1F1B steady state). Transfers negotiate shapes, so microbatches may differ in
shape (e.g. sequence length). Gradients are moved explicitly, as in Megatron-LM: ``F`` stores
``(input, output)`` per microbatch, ``B`` calls ``torch.autograd.backward(output, grad)`` and
sends ``input.grad`` back. The loss of each microbatch is scaled by ``1 / M``, so the
accumulated parameter gradients are those of the mean of the microbatch losses (the full-batch
mean for equal-size microbatches of a mean loss).
"""

from __future__ import annotations

import torch

from ..errors import ShardkitError
from . import p2p
from .schedules import check_deadlock_free, comm_plan, validate_schedule
from .stage import PipelineStage, agree_error

__all__ = ["run_schedule", "split_microbatches"]


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
        raise ShardkitError(f"split_microbatches: {M} microbatches do not divide the batch of {B} "
                            f"(B % M = {B % M}); pick M dividing {B}")
    return list(batch.split(B // M, dim=0))


def run_schedule(stage: PipelineStage, schedule, inputs_microbatches=None, targets_microbatches=None):
    """Run this stage's row of ``schedule`` (forward and backward of every microbatch).

    Collective over the pipeline group: every stage calls it with the same table.

    Args:
        stage: this rank's :class:`PipelineStage`.
        schedule: the full table, one tuple of :class:`~.schedules.Action` per stage (e.g.
            ``one_f_one_b_schedule(P, M)``).
        inputs_microbatches: first stage: ``M`` input tensors (shapes may differ); else ignored.
        targets_microbatches: last stage: ``M`` targets for ``loss_fn``; else ignored.

    Returns:
        Last stage: the ``M`` detached, unscaled microbatch losses; other stages: None.
        Parameter gradients accumulate into ``.grad`` (call ``zero_grad`` between steps).

    Raises:
        ShardkitError: on every stage: the table is malformed, has the wrong number of stages
            or cannot run with blocking P2P (pure checks); the first (last) stage was given a
            number of inputs (targets) other than ``M`` (agreed by one ``all_gather_object``).
    """
    op = "run_schedule"
    if not isinstance(stage, PipelineStage):
        raise ShardkitError(f"{op}: stage must be a PipelineStage, got {type(stage).__name__}")
    P, s = stage.num_stages, stage.stage_index
    M = validate_schedule(schedule, P, op)
    check_deadlock_free(schedule, op)
    agree_error(stage._info, _data_error(stage, M, inputs_microbatches, targets_microbatches), op)
    return _execute(stage, comm_plan(schedule[s], s, P), M, inputs_microbatches, targets_microbatches)


def _data_error(stage, M, inputs, targets) -> str | None:
    for needed, name, xs in ((stage.is_first, "inputs_microbatches", inputs),
                             (stage.is_last, "targets_microbatches", targets)):
        if needed and (not isinstance(xs, (list, tuple)) or len(xs) != M):
            got = len(xs) if isinstance(xs, (list, tuple)) else type(xs).__name__
            return f"stage {stage.stage_index} needs {M} {name} (the schedule's M), got {got}"
    if stage.is_first and not all(isinstance(x, torch.Tensor) for x in inputs):
        return f"stage {stage.stage_index}: every input microbatch must be a tensor"
    return None


def _execute(stage, plan, M, inputs, targets):
    g = stage.group
    received = {}  # (direction, microbatch) -> tensor from a neighbour
    stash = {}  # microbatch -> (input or None, output or scaled loss)
    grads_out = {}  # microbatch -> gradient to send to the previous stage
    outputs = {}  # microbatch -> output to send to the next stage
    losses = [None] * M
    for call in plan:
        if call.api == "compute":
            kind, m = call.action
            if kind == "F":
                outputs[m] = _forward(stage, m, M, inputs, targets, received, stash, losses)
            else:
                grads_out[m] = _backward(stage, m, received, stash)
            continue
        send = None
        if call.sends:
            _, direction, m = call.sends[0]
            send = outputs.pop(m) if direction == "F" else grads_out.pop(m)
        fn = getattr(p2p, call.api)
        got = fn(send, g) if call.sends else fn(g)
        if call.recvs:
            _, direction, m = call.recvs[0]
            received[(direction, m)] = got
    return losses if stage.is_last else None


def _forward(stage, m, M, inputs, targets, received, stash, losses):
    if stage.is_first:
        x = inputs[m]
    else:
        x = received.pop(("F", m)).requires_grad_(True)
    y = stage.forward(x)
    if stage.is_last:
        loss = stage.loss(y, targets[m])
        losses[m] = loss.detach()
        y = loss / M  # gradients of the mean over microbatches
    stash[m] = (None if stage.is_first else x, y)
    return None if stage.is_last else y.detach()


def _backward(stage, m, received, stash):
    x, y = stash.pop(m)
    grad = None if stage.is_last else received.pop(("B", m))
    if y.requires_grad:  # else nothing upstream to differentiate (no parameters, a first stage)
        torch.autograd.backward(y, grad)
    if stage.is_first:
        return None
    # An output that does not depend on the input still owes the previous stage a gradient.
    return x.grad if x.grad is not None else torch.zeros_like(x)
