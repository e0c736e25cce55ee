"""The zero-bubble split of a stage's backward: the input gradient ``I`` now, the weight gradient
``W`` later (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2).

``I`` is on the critical path (the previous stage waits for it); ``W`` only has to run before
the optimizer step, so schedules move it into bubbles. :func:`input_grad` differentiates the
stage's output with respect to its input only, keeps the graph, and records the gradient that
reaches each *branch node*: a node on the path to the input one of whose inputs leads to a
parameter but not to the input (e.g. a linear layer's matmul backward). :func:`weight_grad`
later runs autograd from those nodes to the parameters only (a branch node runs again for its
parameter inputs only; nothing else of ``I`` is computed twice) and adds the result into each
parameter's ``.grad`` as ``backward()`` would. The recorded gradients are held between the two
calls (the memory cost of the split); the graph is freed when the caller drops ``output``.
``W`` runs from the output instead when the input needs no gradient (the first stage) or a
parameter is also reached through the input path below a branch node (weights used twice).

Parameters that get gradients other than through autograd's accumulation (a custom Function
whose backward adds into ``weight.grad`` or ``main_grad`` and returns None for the weight) are
never counted twice: ``I`` notes every parameter whose ``.grad`` or ``main_grad`` changed during
it (tensor identity and version counter), and ``W``, whose autograd pass reruns such a Function,
keeps those parameters' values from before its pass (the Function's second write is dropped;
autograd's contributions are added after). A Function may instead defer its weight gradient to
``W`` (:mod:`.weight_defer`): ``I`` collects the closures, ``W`` runs them once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ..comm.split_pass import input_pass
from ..errors import ShardkitError
from .weight_defer import closures_to_run, collect_deferred

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["PendingWeightGrad", "input_grad", "weight_grad"]


@dataclass
class PendingWeightGrad:
    """What ``I`` leaves for ``W``: ``groups`` of (graph roots, their gradients, the parameters
    behind them); one group rooted at the output when ``W`` starts there; the closures custom
    Functions ``deferred`` during ``I`` (:mod:`.weight_defer`); the parameters whose gradient
    ``I`` ``written`` (changed outside autograd's accumulation); ``owner``, the stage's output
    held while a root is a custom Function's node: the Python object of such a node does not
    keep its C++ node alive (torch's ``get_gradient_edge`` adds an ownership token for the
    same reason), so without the output the root would be freed before ``W``."""

    groups: list[tuple[list[Any], list[torch.Tensor | None], list[torch.nn.Parameter]]]
    done: bool = False
    deferred: list = field(default_factory=list)
    written: list[torch.nn.Parameter] = field(default_factory=list)
    owner: torch.Tensor | None = None


def _marks(params: list[torch.nn.Parameter]) -> list[tuple]:
    """Per parameter, the identity and version of ``.grad`` and ``main_grad``: any write to them
    (in place or a new tensor) changes the mark. Ids are compared while the tensors live."""
    out = []
    for p in params:
        main = getattr(p, "main_grad", None)
        out.append(tuple((id(t), t._version) if isinstance(t, torch.Tensor) else None for t in (p.grad, main)))
    return out


def _keep(params: list[torch.nn.Parameter]) -> list[tuple]:
    """Copies of ``params``' ``.grad`` and ``main_grad`` to restore with :func:`_restore`."""
    kept = []
    for p in params:
        main = getattr(p, "main_grad", None)
        copies = [(t, t.detach().clone()) if isinstance(t, torch.Tensor) else (t, None) for t in (p.grad, main)]
        kept.append((p, copies))
    return kept


def _restore(kept: list[tuple]) -> None:
    with torch.no_grad():
        for p, ((grad, grad_copy), (main, main_copy)) in kept:
            if grad is not None:
                grad.copy_(grad_copy)
            p.grad = grad
            if main is not None:
                main.copy_(main_copy)
                p.main_grad = main


def _check_grad_out(output: torch.Tensor, grad_output: torch.Tensor | None, op: str) -> None:
    if grad_output is None and output.numel() != 1:
        raise ShardkitError(f"{op}: grad_output is required for a non-scalar output of shape {tuple(output.shape)}")
    if grad_output is not None and grad_output.shape != output.shape:
        raise ShardkitError(
            f"{op}: grad_output shape {tuple(grad_output.shape)} does not match output {tuple(output.shape)}"
        )


def _reach_masks(root: Any, targets: list[Any]) -> dict[Any, int]:
    """For every node under ``root``: a bit mask of the ``targets`` reachable from it."""
    bit = {t: 1 << i for i, t in enumerate(targets)}
    mask: dict[Any, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:  # iterative post-order: deep decoder graphs would overflow recursion
        node, expanded = stack.pop()
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            if node not in mask:
                stack.append((node, True))
                stack.extend((c, False) for c in children if c not in mask)
            continue
        m = bit.get(node, 0)
        for c in children:
            m |= mask.get(c, 0)
        mask[node] = m
    return mask


def _weight_roots(
    output: torch.Tensor, stage_input: torch.Tensor, params: list[torch.nn.Parameter]
) -> list[tuple[Any, list[int]]] | None:
    """The branch nodes (on the path to the input, with an input leading to parameters only)
    and the parameters (indices) behind their parameter-only inputs; None when ``W`` must start
    from the output (no path to the input, or a parameter also reached through the input path
    below a branch node, where starting there would count it twice)."""
    root = output.grad_fn
    to_input = _reach_masks(root, [get_gradient_edge(stage_input).node])
    to_param = _reach_masks(root, [get_gradient_edge(p).node for p in params])
    if not to_input.get(root, 0):
        return None
    found = []
    for node, on_path in to_input.items():
        if not on_path:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        only = _or(to_param.get(c, 0) for c in kids if not to_input.get(c, 0))
        through = _or(to_param.get(c, 0) for c in kids if to_input.get(c, 0))
        if only & through:
            return None
        if only:
            found.append((node, [i for i in range(len(params)) if only >> i & 1]))
    return found


def _or(masks: Iterable[int]) -> int:
    """Bitwise or of ``masks``."""
    out = 0
    for m in masks:
        out |= m
    return out


def input_grad(
    stage_input: torch.Tensor,
    output: torch.Tensor,
    params: Iterable[torch.nn.Parameter],
    grad_output: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, PendingWeightGrad]:
    """``I``: the gradient of the stage's input; the graph is kept for :func:`weight_grad`.

    Args:
        stage_input: the tensor the stage's forward consumed (any shape); when it does not
            require grad (the first stage's data) there is no input gradient.
        output: the stage's output (any shape), or its scalar loss on the last stage.
        params: the stage's parameters (those not requiring grad are skipped).
        grad_output: the gradient of ``output`` (same shape); None for a scalar loss.

    Returns:
        ``(dx, pending)``: ``d output / d stage_input`` contracted with ``grad_output`` (shape
        of ``stage_input``; None when it does not require grad), and the state to pass to
        :func:`weight_grad`. Parameters' ``.grad`` is untouched by autograd (a custom Function
        may write it: noted in ``pending.written``).

    Raises:
        ShardkitError: ``grad_output`` missing for a non-scalar output or of the wrong shape.
    """
    _check_grad_out(output, grad_output, "input_grad")
    params = [p for p in params if p.requires_grad]
    from_output = PendingWeightGrad([([output], [grad_output], params)] if params else [])
    if output is stage_input and grad_output is not None:  # a pass-through chunk (nn.Identity)
        return grad_output, from_output
    if not stage_input.requires_grad or output.grad_fn is None:
        return None, from_output
    found = _weight_roots(output, stage_input, params) if params else []
    seen: dict[Any, tuple] = {}
    hooks = [n.register_prehook(lambda gos, n=n: seen.__setitem__(n, gos)) for n, _ in found or []]
    before = _marks(params)
    try:
        with collect_deferred() as deferred, input_pass():  # a Function may leave its weight to W
            (dx,) = torch.autograd.grad(output, stage_input, grad_output, retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    written = [p for p, a, b in zip(params, before, _marks(params), strict=True) if a != b]
    dx = torch.zeros_like(stage_input) if dx is None else dx
    if found is None:
        from_output.deferred, from_output.written = deferred, written
        return dx, from_output
    groups = []
    for node, idx in found:
        edges = [(GradientEdge(node, i), g) for i, g in enumerate(seen.get(node, ())) if g is not None]
        if edges:
            groups.append(([e for e, _ in edges], [g for _, g in edges], [params[i] for i in idx]))
    python_node = any(isinstance(e.node, torch._C._FunctionBase) for roots, _, _ in groups for e in roots)
    owner = output if python_node else None
    return dx, PendingWeightGrad(groups, deferred=deferred, written=written, owner=owner)


def weight_grad(pending: PendingWeightGrad) -> None:
    """``W``: add the parameters' gradients into their ``.grad``.

    Gradients accumulate over calls (microbatches) as ``backward()`` accumulates them.

    Args:
        pending: what :func:`input_grad` returned for this microbatch.

    Raises:
        ShardkitError: ``pending`` was already used.
    """
    if pending.done:
        raise ShardkitError("weight_grad: this microbatch's weight gradient ran already")
    pending.done = True
    groups, pending.groups = pending.groups, []  # drop the recorded gradients with the graph
    owner, pending.owner = pending.owner, None  # alive (with its graph) until this pass is done
    written = {id(p) for p in pending.written}
    kept = _keep(pending.written)  # what I wrote; this pass may run the writing Function again
    later: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    from_w: list = []  # closures deferred by this pass (reruns of I's nodes, or nodes I never reached)
    for roots, grads, params in groups:
        with collect_deferred() as deferred:
            got = torch.autograd.grad(roots, params, grads, retain_graph=True, allow_unused=True)
        from_w += deferred
        for p, g in zip(params, got, strict=True):
            if g is None:
                continue
            if id(p) in written:
                later.append((p, g))  # after the restore below
            else:
                _accumulate(p, g)
    del owner  # the graph may be freed now
    _restore(kept)
    for fn in closures_to_run(pending.deferred, from_w):
        fn()
    pending.deferred = []
    for p, g in later:
        _accumulate(p, g)


def _accumulate(p: torch.nn.Parameter, g: torch.Tensor) -> None:
    """Add ``g`` into ``p.grad`` as ``backward()`` accumulates it."""
    with torch.no_grad():
        if p.grad is None:
            p.grad = g.detach().clone()
        else:
            p.grad.add_(g)
