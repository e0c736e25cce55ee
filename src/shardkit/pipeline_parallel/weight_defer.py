"""Deferred weight gradients for custom autograd Functions under the zero-bubble ``I``/``W`` split.

A custom ``torch.autograd.Function`` whose backward computes its weight's gradient itself (adds
it into ``weight.grad`` or a ``main_grad`` buffer and returns None for the weight, as fused or
communication-overlapping linear layers do) can hand that work to ``W`` instead of running it in
``I``: in its backward, ``if deferring(): defer(fn) else: fn()`` with ``fn`` a closure that adds
the weight gradient. The pipeline runner turns deferring on around an ``I`` step's autograd pass
and keeps the closures of that microbatch and chunk; the matching ``W`` runs them, in the order
they were deferred. Outside an ``I`` (a plain ``B``, no pipeline at all) ``deferring()`` is
False and the Function runs ``fn`` at once, so the same Function is exact everywhere.

Which closures ``W`` runs. ``W``'s own autograd pass (:func:`~.split_backward.weight_grad`)
reruns the nodes that feed the weights, a deferring Function among them when its weight is an
input of it, and a Function that ``I`` never reached (the first chunk, whose input needs no
gradient; a branch that leads to weights only) runs there for the first time. Each closure is
kept with the autograd node that deferred it (``torch._C._current_autograd_node()``, through
``comm._compat``): ``W`` runs ``I``'s closures and, of its own pass's, those of nodes that
deferred nothing in ``I``, so every node's weight gradient is added once.

A Function that writes ``.grad`` in ``I`` without deferring is exact too, at the cost of its
weight-gradient work running in ``I``: :func:`~.split_backward.input_grad` notes the parameters
whose ``.grad`` (or ``main_grad``) changed during ``I`` and :func:`~.split_backward.weight_grad`
keeps those values over ``W``'s second run of the Function (it reruns because ``W`` starts at the
nodes that feed the weights, the Function's own node among them).

Source: the pattern of DeepSeek's DualPipe (its ``WeightGradStore``: a Function queues its
weight-gradient closure while the schedule splits a backward; the schedule pops and runs the
queue at the weight step). This is shardkit's own interface and code.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..comm._compat import current_autograd_node
from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["deferring", "defer", "collect_deferred", "closures_to_run"]

_STATE = threading.local()  # one rank per thread in tests; the queue of the running I or W, or None


def _queue() -> list | None:
    return getattr(_STATE, "queue", None)


def deferring() -> bool:
    """Whether a Function's backward runs inside a split ``I`` (or ``W``) step and should hand
    its weight-gradient closure to :func:`defer` instead of running it."""
    return _queue() is not None


def defer(fn: Callable[[], None]) -> None:
    """Queue ``fn`` (no arguments; adds one weight gradient) for this microbatch's ``W`` step.

    Raises:
        ShardkitError: called while :func:`deferring` is False (the closure would be lost), or
            ``fn`` is not callable.
    """
    queue = _queue()
    if queue is None:
        raise ShardkitError("defer: no split backward is running (check deferring() first and call fn() otherwise)")
    if not callable(fn):
        raise ShardkitError(f"defer: fn must be callable, got {type(fn).__name__}")
    queue.append((current_autograd_node(), fn))  # the node: see "Which closures W runs"


@contextmanager
def collect_deferred() -> Iterator[list[tuple[Any, Callable[[], None]]]]:
    """Turn deferring on for the block; yields the list of ``(autograd node, closure)`` the
    block's :func:`defer` calls fill. A nested block collects into its own list."""
    outer = _queue()
    _STATE.queue = []
    try:
        yield _STATE.queue
    finally:
        _STATE.queue = outer


def closures_to_run(from_i: list[tuple[Any, Callable[[], None]]], from_w: list[tuple[Any, Callable[[], None]]]) -> list:
    """The closures ``W`` runs (pure): every one ``I`` deferred, then those ``W``'s own pass
    deferred from nodes that deferred nothing in ``I`` (a node rerun by ``W`` defers the same
    closure again, on the same recorded gradient)."""
    seen = {id(node) for node, _ in from_i if node is not None}
    return [fn for _, fn in from_i] + [fn for node, fn in from_w if node is None or id(node) not in seen]
