"""A custom Function does only its share of a split backward (:mod:`shardkit.comm.split_pass`).

A linear Function that asks :func:`in_input_pass` and :func:`will_execute` (as
``tensor_parallel.sp_saved`` does) is run through the zero-bubble ``I`` and ``W``
(:func:`input_grad`, :func:`weight_grad`) and through a plain ``backward()``, in float64 with
coordinate-encoded values: every gradient equals the plain one bit for bit, ``I`` computes the
input gradient only and ``W`` the weight gradient only (each once), and the plain backward both.
"""

import torch

from shardkit.comm.split_pass import in_input_pass, input_pass, will_execute
from shardkit.pipeline_parallel.split_backward import input_grad, weight_grad

CALLS: list[str] = []


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0] and will_execute(ctx.next_functions[0])
        need_w = ctx.needs_input_grad[1] and not in_input_pass()
        CALLS.append("x" * need_x + "w" * need_w)
        return (g @ w if need_x else None), (g.t() @ x if need_w else None)


def _model():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.arange(12, dtype=torch.float64).view(3, 4) / 10)  # coordinate-encoded
    b = torch.nn.Parameter(torch.arange(15, dtype=torch.float64).view(5, 3) / 7 - 1)
    x = (torch.arange(8, dtype=torch.float64).view(2, 4) / 3).requires_grad_(True)
    return a, b, x


def _forward(a, b, x):
    h = torch.tanh(x * 1.5)  # the stage input's path runs through a plain op, then the Function
    return (_Linear.apply(_Linear.apply(h, a), b) ** 2).sum()


def test_plain_backward_computes_both_once():
    a, b, x = _model()
    CALLS.clear()
    _forward(a, b, x).backward()
    assert CALLS == ["xw", "xw"]


def test_split_gives_the_plain_gradients_and_each_pass_its_share():
    a, b, x = _model()
    _forward(a, b, x).backward()
    want = (x.grad.clone(), a.grad.clone(), b.grad.clone())
    a2, b2, x2 = _model()
    loss = _forward(a2, b2, x2)
    CALLS.clear()
    dx, pending = input_grad(x2, loss, [a2, b2])
    assert CALLS == ["x", "x"]  # I: input gradients only (no weight matmul)
    assert a2.grad is None and b2.grad is None
    CALLS.clear()
    weight_grad(pending)
    assert sorted(CALLS) == ["w", "w"]  # W: each Function once, for its weight only
    assert torch.equal(dx, want[0]) and torch.equal(a2.grad, want[1]) and torch.equal(b2.grad, want[2])


def test_the_flag_is_scoped():
    assert not in_input_pass()
    with input_pass():
        assert in_input_pass()
        with input_pass():
            assert in_input_pass()
        assert in_input_pass()
    assert not in_input_pass()
    assert will_execute((None, 0))  # nothing to ask the engine: compute
