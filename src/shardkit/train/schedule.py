"""Learning-rate schedule for fine-tuning: linear warm-up, then cosine decay to a floor.

A pretrained model sits in a sharp minimum: AdamW's first steps move every weight by about
``lr`` whatever its gradient's size, so a from-scratch rate (1e-3) wrecks it (issue 10: a pretrained
loss went from 5.7 to 10 in two steps). Fine-tuning recipes (Hugging Face's ``Trainer``
defaults, the Llama / SmolLM fine-tuning scripts) use ~1e-5..1e-4, reached by a linear warm-up
(Adam's second-moment estimate is noisy for the first steps) and decayed by a half cosine
(Loshchilov & Hutter, "SGDR", 2017) to a floor.

Built from torch's own schedulers (``LinearLR`` -> ``CosineAnnealingLR`` in a ``SequentialLR``),
so its ``state_dict`` resumes with the optimizer's.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from ..errors import ShardkitError
from .options import FINETUNE_LR  # where the launcher's torch-free checks read it

__all__ = ["FINETUNE_LR", "MIN_LR_RATIO", "default_warmup_steps", "warmup_cosine", "fast_forward"]

# The cosine ends at this fraction of the peak rate (not 0: the last steps still learn).
MIN_LR_RATIO = 0.1


def default_warmup_steps(steps: int) -> int:
    """10 % of the run, at least one step when there is more than one (none for a 1-step run)."""
    return 0 if steps <= 1 else max(1, steps // 10)


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    steps: int,
    warmup_steps: int | None = None,
    min_lr_ratio: float = MIN_LR_RATIO,
) -> LRScheduler:
    """Linear warm-up to each group's ``lr``, then half-cosine decay to ``min_lr_ratio * lr``.

    With peak ``L``, warm-up ``W`` and ``T`` steps, the rate used by optimizer step
    ``t = 0 .. T-1`` (call ``scheduler.step()`` after each ``optimizer.step()``) is

    - ``L * (t + 1) / (W + 1)`` for ``t < W`` (the first step already learns, at ``L / (W + 1)``),
    - ``m + (L - m) * (1 + cos(pi * (t - W) / (T - 1 - W))) / 2`` for ``W <= t < T``, with
      ``m = min_lr_ratio * L``: ``L`` at ``t = W``, ``m`` at the last step ``t = T - 1``.

    The schedule is defined for ``T`` steps; torch's cosine rises again after them.

    Args:
        optimizer: its param groups' ``lr`` are the peaks.
        steps: ``T``, the run's total optimizer steps (a resumed run passes the same total).
        warmup_steps: ``W``; None: :func:`default_warmup_steps`. Clamped to ``T - 1``.
        min_lr_ratio: floor of the decay as a fraction of the peak, in [0, 1].

    Returns:
        A ``torch.optim.lr_scheduler.LRScheduler`` (``SequentialLR``, or ``CosineAnnealingLR``
        alone when ``W`` is 0).

    Raises:
        ShardkitError: ``steps < 1``, ``warmup_steps < 0`` or ``min_lr_ratio`` outside [0, 1].
    """
    if steps < 1:
        raise ShardkitError(f"lr schedule: --steps must be >= 1, got {steps}")
    if warmup_steps is None:
        warmup_steps = default_warmup_steps(steps)
    if warmup_steps < 0:
        raise ShardkitError(f"lr schedule: --warmup-steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ShardkitError(f"lr schedule: the floor ratio must be in [0, 1], got {min_lr_ratio}")
    w = min(warmup_steps, steps - 1)
    # eta_min is one number for every group: a per-group floor would need per-group schedulers.
    peaks = {group["lr"] for group in optimizer.param_groups}
    if len(peaks) != 1:
        raise ShardkitError(
            f"lr schedule: the optimizer's param groups have different lr {sorted(peaks)}; "
            "warmup_cosine takes one peak rate"
        )
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, steps - 1 - w), eta_min=min_lr_ratio * peaks.pop())
    if w == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=1.0 / (w + 1), end_factor=1.0, total_iters=w)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[w])


def fast_forward(scheduler: LRScheduler, optimizer: torch.optim.Optimizer, steps: int, done: int) -> None:
    """Put a :func:`warmup_cosine` ``scheduler`` of ``optimizer`` where it is after ``done`` steps
    of a ``steps``-step run (a resumed run), and set each group's ``lr`` to the rate of step ``done``.

    The schedule is a function of the step count, replayed here on a stand-in optimizer of one
    parameter that takes a (gradient-free, so empty) step before each scheduler step, as in
    training; the stand-in's state then becomes ``scheduler``'s. Stepping ``scheduler`` itself
    ``done`` times before this process's first ``optimizer.step()`` would print torch's
    "``lr_scheduler.step()`` before ``optimizer.step()``" warning on every rank (issue 32).

    Args:
        scheduler: built by :func:`warmup_cosine` on ``optimizer`` with the same ``steps``.
        optimizer: the run's optimizer (its state already loaded).
        steps: the run's total steps.
        done: the steps the save had taken (0: nothing to do).
    """
    if done == 0:
        return
    peak = optimizer.param_groups[0].get("initial_lr", optimizer.defaults["lr"])  # the schedule's peak
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=peak)
    replay = warmup_cosine(stand_in, steps)
    for _ in range(done):
        stand_in.step()  # no gradient: nothing moves, but torch sees the optimizer step first
        replay.step()
    scheduler.load_state_dict(replay.state_dict())
    for group in optimizer.param_groups:  # as each scheduler step would have set it
        group["lr"] = stand_in.param_groups[0]["lr"]
