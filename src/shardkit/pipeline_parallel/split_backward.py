"""The zero-bubble split of a stage's backward: the input gradient ``I`` now, the weight gradient
``W`` later (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2).

``I`` is on the critical path (the previous stage waits for it); ``W`` only has to run before
the optimizer step, so schedules move it into bubbles. :func:`input_grad` differentiates the
stage's output with respect to its input only and keeps the graph; :func:`weight_grad` later
differentiates the same output with respect to the parameters, frees the graph and adds the
result into each parameter's ``.grad`` exactly as ``backward()`` would.

Cost: ``W`` walks the graph again from the output to the parameters, so the activation-gradient
chain between them is computed twice (once per call); zero-bubble runtimes that keep those
intermediate gradients avoid that, at the memory of holding them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["input_grad", "weight_grad"]


def _grad_out(output: torch.Tensor, grad_output: torch.Tensor | None, op: str) -> torch.Tensor | None:
    if grad_output is None and output.numel() != 1:
        raise ShardkitError(f"{op}: grad_output is required for a non-scalar output of shape {tuple(output.shape)}")
    if grad_output is not None and grad_output.shape != output.shape:
        raise ShardkitError(
            f"{op}: grad_output shape {tuple(grad_output.shape)} does not match output {tuple(output.shape)}"
        )
    return grad_output


def input_grad(
    stage_input: torch.Tensor, output: torch.Tensor, grad_output: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``I``: the gradient of the stage's input, the graph kept for :func:`weight_grad`.

    Args:
        stage_input: the tensor the stage's forward consumed (any shape); when it does not
            require grad (the first stage's data) there is no input gradient.
        output: the stage's output (any shape), or its scalar loss on the last stage.
        grad_output: the gradient of ``output`` (same shape); None for a scalar loss.

    Returns:
        ``d output / d stage_input`` contracted with ``grad_output`` (shape of ``stage_input``),
        or None when ``stage_input`` does not require grad. Parameters' ``.grad`` is untouched.

    Raises:
        ShardkitError: ``grad_output`` missing for a non-scalar output or of the wrong shape.
    """
    grad_output = _grad_out(output, grad_output, "input_grad")
    if not stage_input.requires_grad:
        return None
    (g,) = torch.autograd.grad(output, stage_input, grad_output, retain_graph=True, allow_unused=True)
    return torch.zeros_like(stage_input) if g is None else g


def weight_grad(
    params: Iterable[torch.nn.Parameter], output: torch.Tensor, grad_output: torch.Tensor | None = None
) -> None:
    """``W``: add the parameters' gradients into their ``.grad`` and free the graph.

    Call it once per microbatch after :func:`input_grad` (or alone, when the input needs no
    gradient). Gradients accumulate over calls as ``backward()`` accumulates them.

    Args:
        params: the stage's parameters (those not requiring grad, or not reached, are skipped).
        output: the same ``output`` given to :func:`input_grad`.
        grad_output: the same ``grad_output``.

    Raises:
        ShardkitError: as :func:`input_grad`.
    """
    grad_output = _grad_out(output, grad_output, "weight_grad")
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    grads = torch.autograd.grad(output, params, grad_output, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)
