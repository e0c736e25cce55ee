"""Which part of a split backward is running: what a custom Function's backward may skip.

The zero-bubble schedules split a stage's backward into the input gradient ``I`` and the weight
gradient ``W`` (:mod:`shardkit.pipeline_parallel.split_backward`): ``I`` differentiates the
stage's output with respect to its input only, and ``W`` later reruns each *branch node* (a node
one of whose inputs leads to a parameter and not to the stage input) for its parameters. A
custom ``torch.autograd.Function``'s ``ctx.needs_input_grad`` is fixed at forward, so without
help its backward computes every gradient in both passes, and autograd drops the ones the pass
did not ask for. Two questions let it do only its share:

* :func:`in_input_pass`: an ``I`` pass is running. A Function whose weight input is a parameter
  is a branch node of that pass, so ``W`` runs it again; its weight gradient can wait for ``W``.
* :func:`will_execute`: the engine will run the node at the end of an edge in this pass
  (``torch._C._will_engine_execute_node``). ``W`` does not go down the input edge of a branch
  node, so its input gradient there is dropped work.

A plain ``backward()`` (no split) runs neither flag: every gradient is computed once.

Used by :mod:`shardkit.tensor_parallel.sp_saved`, whose weight gradient needs an all-gather
(without these, ``I`` gathered and multiplied for nothing and ``W`` gathered again).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["in_input_pass", "input_pass", "will_execute"]

_STATE = threading.local()  # one rank per thread in tests


def in_input_pass() -> bool:
    """Whether the running autograd pass is a split backward's ``I`` (:func:`input_pass`)."""
    return bool(getattr(_STATE, "input", False))


@contextmanager
def input_pass() -> Iterator[None]:
    """Mark the block as an ``I`` pass (``split_backward.input_grad`` wraps its autograd call)."""
    outer = in_input_pass()
    _STATE.input = True
    try:
        yield
    finally:
        _STATE.input = outer


def will_execute(edge: tuple[Any, int]) -> bool:
    """Whether the running backward pass will run the node of ``edge`` (an entry of a node's
    ``next_functions``). True where the engine cannot say (a leaf under ``autograd.grad``, a
    missing node, outside a backward): computing a gradient nobody reads is only wasted work."""
    node = edge[0]
    if node is None:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):
        return True
