"""Layout copies per call (issue 24): every collective copies each element at most once on each
side of its c10d call, and not at all where the blocks already lie where they go.

A dispatch mode counts the elements written by the data-moving aten ops (copy, clone, cat,
index_select, repeat, ...) during one forward or one backward; the expected numbers are the table
of docs/guides/comm.md: ``pack`` = the input's numel when the per-rank blocks of the scattered dim
are not consecutive in memory (a dim before it has size > 1), ``unpack`` = the output's numel when
the received blocks cannot land in place (a dim before the gathered dim has size > 1).
"""

import contextlib
import itertools
import math
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.helpers import rank, world_group, world_size
from shardkit import (
    all_gather,
    all_to_all,
    balanced_split_sizes,
    gather_forward_split_backward,
    reduce_scatter,
    split_forward_gather_backward,
)
from shardkit.comm import _c10d

_aten = torch.ops.aten
# Ops that write a tensor's worth of elements taken from another: the layout copies.
_COPIES = {
    _aten.copy_.default,
    _aten.clone.default,
    _aten.cat.default,
    _aten.cat.out,
    _aten.stack.default,
    _aten.index_select.default,
    _aten.index_select.out,
    _aten.index.Tensor,
    _aten.repeat.default,
    _aten._to_copy.default,
    _aten.narrow_copy.default,
    _aten.gather.default,
}


class _Copies(TorchDispatchMode):
    """Elements written by layout copies while active (``ops``: their names, for messages).

    What the c10d call does inside is the backend's, not counted: gloo emulates
    ``reduce_scatter_tensor`` with an all-reduce and a copy of this rank's block (NCCL has a
    native one)."""

    def __init__(self):
        super().__init__()
        self.elements, self.ops, self.in_c10d = 0, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _COPIES and not self.in_c10d:
            written = args[0] if func is _aten.copy_.default else kwargs.get("out", out) if kwargs else out
            self.elements += written.numel()
            self.ops.append(str(func))
        return out


@contextlib.contextmanager
def _counting():
    """A :class:`_Copies` mode that stops counting inside the c10d calls the helpers make."""
    mode = _Copies()

    def outside(real):
        def call(*args, **kwargs):
            mode.in_c10d = True
            try:
                return real(*args, **kwargs)
            finally:
                mode.in_c10d = False

        return call

    with contextlib.ExitStack() as stack:
        for name in ("all_gather_single", "reduce_scatter_single"):
            stack.enter_context(mock.patch.object(_c10d, name, outside(getattr(_c10d, name))))
        for name in ("all_to_all_single", "all_reduce"):
            stack.enter_context(mock.patch.object(_c10d.dist, name, outside(getattr(_c10d.dist, name))))
        with mode:
            yield mode


def _count(op, x):
    """(forward, backward) elements copied by ``op`` on ``x``, and the output."""
    x = x.detach().requires_grad_()
    torch.autograd.grad(op(x), x, torch.ones_like(op(x)))  # builds the per-shape plans (index tensors), once per run
    with _counting() as fw:
        y = op(x)
    cot = torch.ones_like(y)
    with _counting() as bw:
        (gx,) = torch.autograd.grad(y, x, cot)
    assert gx.shape == x.shape
    return fw, bw, y


def _lead(shape, dim) -> int:
    """Product of the dims before ``dim``: 1 when blocks along ``dim`` are consecutive in memory."""
    return math.prod(shape[:dim])


def _moved(shape, lead) -> int:
    return math.prod(shape) if lead > 1 else 0


def _gather_sizes(even: bool) -> list[int]:
    return [2] * world_size() if even else [3, 0, 1][: world_size()]


LAYOUTS = list(itertools.product(range(4), (1, 2), (True, False)))  # (dim, B, even)


def _local(dim, b, sizes):
    shape = [b, 3, 2, 2]
    shape[dim] = sizes[rank()]
    return torch.arange(math.prod(shape), dtype=torch.float64).view(shape) + rank()


def _gather_expected(shape, dim, sizes):
    """(forward, backward) elements of an all-gather of a local ``shape`` along ``dim`` and of its adjoint."""
    out = list(shape)
    out[dim] = sum(sizes)
    lead = _lead(out, dim)
    repeat = 0 if len(set(sizes)) == 1 else world_size() * math.prod(shape)  # uneven: the send buffer
    return repeat + _moved(out, lead), _moved(out, lead)


@pytest.mark.world(2)
@pytest.mark.parametrize(("dim", "b", "even"), LAYOUTS)
def test_all_gather_and_reduce_scatter_copies_r2(dim, b, even):
    _check_gather_scatter(dim, b, even)


@pytest.mark.world(3)
@pytest.mark.parametrize(("dim", "b", "even"), LAYOUTS)
def test_all_gather_and_reduce_scatter_copies_r3(dim, b, even):
    _check_gather_scatter(dim, b, even)


def _check_gather_scatter(dim, b, even):
    g, sizes = world_group(), _gather_sizes(even)
    x = _local(dim, b, sizes)
    fw, bw, y = _count(lambda t: all_gather(t, g, dim, sizes), x)
    assert (fw.elements, bw.elements) == _gather_expected(x.shape, dim, sizes), (fw.ops, bw.ops)
    assert y.is_contiguous()
    # reduce_scatter is the adjoint: its forward copies like all_gather's backward and back.
    fw2, bw2, _ = _count(lambda t: reduce_scatter(t, g, dim, sizes), y.detach())
    assert (fw2.elements, bw2.elements) == (bw.elements, fw.elements), (fw2.ops, bw2.ops)
    # The TP regions: split copies its block out (a new tensor, never a view of the input); the
    # backward of a gather hands back a view of the gradient where the block is consecutive.
    fw3, bw3, _ = _count(lambda t: gather_forward_split_backward(t, g, dim, sizes), x)
    whole = x.shape[dim] == y.shape[dim]  # this rank holds the whole dim: its block is consecutive
    view = 0 if whole else _moved(x.shape, _lead(y.shape, dim))
    assert (fw3.elements, bw3.elements) == (fw.elements, view), (fw3.ops, bw3.ops)
    fw4, bw4, _ = _count(lambda t: split_forward_gather_backward(t, g, dim, sizes), y.detach())
    assert (fw4.elements, bw4.elements) == (x.numel(), fw.elements), (fw4.ops, bw4.ops)


A2A = list(itertools.product(itertools.permutations(range(4), 2), (1, 2), (True, False)))  # (dims, B, even)


def _a2a_input(s, g, b, even):
    """This rank's block along ``g`` of a full ``[B, S, N, D]`` tensor, and the full gathered size."""
    r = world_size()
    full = [b, 2 * r, 2 * r, 2] if even else [b, 2 * r + 1, 2 * r - 1, 3]
    full[0] = b if 0 not in (s, g) else (2 * r if even else 2 * r + 1)
    sizes = balanced_split_sizes(full[g], r)
    local = list(full)
    local[g] = sizes[rank()]
    return torch.arange(math.prod(local), dtype=torch.float64).view(local) + rank(), full[g]


def _a2a_expected(x_shape, s, g, gather_size):
    r = world_size()
    out = list(x_shape)
    out[s] = balanced_split_sizes(x_shape[s], r)[rank()]
    out[g] = gather_size
    pack, unpack = _moved(x_shape, _lead(x_shape, s)), _moved(out, _lead(out, g))
    # Backward is the reverse all-to-all: the output's gradient packed along g, unpacked along s.
    return pack + unpack, _moved(out, _lead(out, g)) + _moved(x_shape, _lead(x_shape, s))


@pytest.mark.world(2)
@pytest.mark.parametrize(("dims", "b", "even"), A2A)
def test_all_to_all_copies_r2(dims, b, even):
    _check_a2a(*dims, b, even)


@pytest.mark.world(3)
@pytest.mark.parametrize(("dims", "b", "even"), A2A)
def test_all_to_all_copies_r3(dims, b, even):
    _check_a2a(*dims, b, even)


def _check_a2a(s, g, b, even):
    x, gather_size = _a2a_input(s, g, b, even)
    fw, bw, y = _count(lambda t: all_to_all(t, world_group(), s, g, gather_size), x)
    assert (fw.elements, bw.elements) == _a2a_expected(x.shape, s, g, gather_size), (fw.ops, bw.ops)
    assert y.is_contiguous()
    # At most one copy on each side of the call, and none on a side whose dim is outermost.
    assert fw.elements <= x.numel() + y.numel()
