"""What a :func:`~.runner.run_schedule` call runs and returns: training or forward-only, the
scaling of the microbatch losses, the outputs (pure checks; both runners share them).

* ``train``: ``True`` runs the table (forwards and backwards); ``False`` runs its forward-only
  table (:func:`.steps.forward_only`: no gradient message, no stored activation, under
  ``torch.no_grad``); ``None`` (default) follows ``torch.is_grad_enabled()``, so a call under
  ``torch.no_grad()`` is an eval call on every schedule, zero-bubble ``I``/``W`` ones included.
* ``scale_grads``: ``True`` back-propagates ``loss / M`` (parameter gradients of the mean of
  the microbatch losses: torch.distributed.pipelining's default); ``False`` back-propagates each
  ``loss`` (the sum: torch's ``scale_grads=False``, DualPipe).
* ``return_outputs``: also return the last chunk's outputs (detached), one per microbatch.

Source: torch.distributed.pipelining's ``step``/``eval`` and ``scale_grads``; DualPipe's
``step(..., return_outputs=...)`` under ``torch.no_grad()`` (its inference step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from torch import nn

__all__ = ["RunMode", "TRAIN", "ScheduleOutput", "resolve_mode", "targets_needed", "accumulate_hooks"]


class RunMode(NamedTuple):
    """A call's mode (see the module docstring)."""

    train: bool
    scale_grads: bool
    return_outputs: bool


TRAIN = RunMode(True, True, False)  # run_schedule's defaults with gradients enabled


class ScheduleOutput(NamedTuple):
    """What ``run_schedule(..., return_outputs=True)`` returns on every rank: on the rank holding
    the last chunk, ``losses`` (``M`` detached, unscaled losses; None in an eval call without
    targets) and ``outputs`` (``M`` detached outputs of the last chunk, before the loss); on the
    other ranks both None."""

    losses: list[torch.Tensor] | None
    outputs: list[torch.Tensor] | None


def resolve_mode(train: object, scale_grads: object, return_outputs: object) -> tuple[RunMode, str | None]:
    """The call's :class:`RunMode` and this rank's error (None: fine). Pure but for the grad
    mode; the caller agrees the error (and the table, which the mode changes) over every rank,
    so a rank under ``torch.no_grad()`` beside training ranks is refused on all of them."""
    grad = torch.is_grad_enabled()
    mode = RunMode(grad if train is None else bool(train), bool(scale_grads), bool(return_outputs))
    for name, x in (("train", train), ("scale_grads", scale_grads), ("return_outputs", return_outputs)):
        if not isinstance(x, bool) and not (name == "train" and x is None):
            return mode, f"{name} must be a bool{' or None' if name == 'train' else ''}, got {x!r}"
    if mode.train and not grad:
        return mode, "train=True under torch.no_grad(): enable gradients or pass train=False (forward-only)"
    return mode, None


def targets_needed(mode: RunMode, targets: object) -> bool:
    """Whether the last stage needs ``M`` targets: always to train; in a forward-only call only
    when given or when nothing else would be returned (``return_outputs=False``)."""
    return mode.train or targets is not None or not mode.return_outputs


def accumulate_hooks(module: nn.Module) -> list[str]:
    """The parameters of ``module`` with post-accumulate-grad hooks (pure).

    Such hooks fire when autograd accumulates a parameter's ``.grad``; the ``W`` of the I/W split
    adds gradients itself (:func:`~.split_backward.weight_grad`), so they would never fire: a
    chunk with any runs its ``I`` steps as plain ``B`` (its ``W`` steps then do nothing)."""
    return [n for n, p in module.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
