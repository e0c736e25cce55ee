"""The zero-bubble I/W split of a stage's backward against a plain ``backward()``, in float64:
bitwise equal input gradients and parameter gradients, accumulated over several microbatches
in the order the W steps run."""

import pytest
import torch
from torch import nn

from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel.split_backward import input_grad, weight_grad
from shardkit.pipeline_parallel.weight_defer import defer, deferring


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.LayerNorm(10), nn.Linear(10, 6)).double()


def _block():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True).double()


def _twin(build):
    a, b = build(), build()
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize(("build", "shape"), [(_mlp, (3, 6)), (_block, (2, 5, 8))], ids=["mlp", "decoder-block"])
def test_split_equals_backward_bitwise_over_microbatches(build, shape):
    ref, split = _twin(build)
    torch.manual_seed(1)
    xs = [torch.randn(shape, dtype=torch.float64) for _ in range(3)]
    gys = [torch.randn(shape, dtype=torch.float64) for _ in range(3)]
    w_order = [1, 0, 2]  # W deferred and out of order, as zero-bubble schedules run it

    ref_dx = {}
    for j in w_order:
        x = xs[j].clone().requires_grad_()
        ref(x).backward(gys[j])
        ref_dx[j] = x.grad

    saved = {}
    for j in range(3):  # I of every microbatch first: no parameter gradient yet
        x = xs[j].clone().requires_grad_()
        y = split(x)
        dx, saved[j] = input_grad(x, y, split.parameters(), gys[j])
        assert torch.equal(dx, ref_dx[j])
        assert len(saved[j].groups) > 1  # W starts at the branch nodes, not at the output
    assert all(p.grad is None for p in split.parameters())
    for j in w_order:
        weight_grad(saved[j])
    for (name, p), q in zip(ref.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_last_stage_scalar_loss_and_first_stage_input():
    ref, split = _twin(_mlp)
    x = torch.randn(4, 6, dtype=torch.float64)
    t = torch.randn(4, 6, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss

    xr = x.clone().requires_grad_()
    loss_fn(ref(xr), t).backward()
    xs = x.clone().requires_grad_()
    loss = loss_fn(split(xs), t)
    dx, pending = input_grad(xs, loss, split.parameters())
    assert torch.equal(dx, xr.grad)
    weight_grad(pending)
    for p, q in zip(ref.parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)

    # the first stage's data needs no gradient: I is empty, W still accumulates
    ref2, split2 = _twin(_mlp)
    ref2(x).backward(t)
    y = split2(x)
    dx, pending = input_grad(x, y, split2.parameters(), t)
    assert dx is None
    weight_grad(pending)
    for p, q in zip(ref2.parameters(), split2.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls."""

    calls = [0]

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Count.calls[0] += 1
        return g


def test_weight_grad_does_not_rerun_the_input_gradient_chain():
    ref, split = _twin(_mlp)
    x = torch.randn(3, 6, dtype=torch.float64)
    g = torch.randn(3, 6, dtype=torch.float64)

    def run(m, inp):
        return m[3](m[2](_Count.apply(m[1](m[0](inp)))))

    xr = x.clone().requires_grad_()
    run(ref, xr).backward(g)
    _Count.calls[0] = 0
    xs = x.clone().requires_grad_()
    dx, pending = input_grad(xs, run(split, xs), split.parameters(), g)
    assert _Count.calls[0] == 1
    weight_grad(pending)
    assert _Count.calls[0] == 1  # W started below the counting node: it ran once in all
    assert torch.equal(dx, xr.grad)
    for p, q in zip(ref.parameters(), split.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(ShardkitError, match="ran already"):
        weight_grad(pending)


def test_a_weight_used_twice_falls_back_to_the_output_and_stays_exact():
    torch.manual_seed(0)
    lin = nn.Linear(5, 5).double()
    ref = nn.Linear(5, 5).double()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(2, 5, dtype=torch.float64)
    g = torch.randn(2, 5, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref(torch.tanh(ref(xr))).backward(g)
    xs = x.clone().requires_grad_()
    dx, pending = input_grad(xs, lin(torch.tanh(lin(xs))), lin.parameters(), g)
    assert len(pending.groups) == 1  # rooted at the output: the outer matmul's weight is reached below it too
    weight_grad(pending)
    assert torch.equal(dx, xr.grad)
    for p, q in zip(ref.parameters(), lin.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("grad", "match"), [(None, "grad_output is required"), (torch.ones(3, 2, dtype=torch.float64), "does not match")]
)
def test_bad_grad_output_is_refused(grad, match):
    m = _mlp()
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    y = m(x)
    with pytest.raises(ShardkitError, match=match):
        input_grad(x, y, m.parameters(), grad)


class _WritesGrad(torch.autograd.Function):
    """``x @ w.T`` whose backward adds ``w``'s gradient into ``w.grad`` or ``w.main_grad`` itself
    (deferred to W when asked) and returns None for ``w``."""

    mode = "grad"  # "grad", "main" or "defer"

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors

        def add():
            g = gy.flatten(0, -2).T @ x.flatten(0, -2)
            if _WritesGrad.mode == "main":
                w.main_grad.add_(g)
            else:
                w.grad = g if w.grad is None else w.grad.add_(g)

        if _WritesGrad.mode == "defer" and deferring():
            defer(add)
        else:
            add()
        return gy @ w, None


class _FuncNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.w1 = nn.Parameter(torch.randn(5, 5, dtype=torch.float64))
        self.lin = nn.Linear(5, 5, dtype=torch.float64)
        self.w2 = nn.Parameter(torch.randn(5, 5, dtype=torch.float64))

    def forward(self, x):
        return _WritesGrad.apply(self.lin(torch.tanh(_WritesGrad.apply(x, self.w1))), self.w2)


def _grads(net):
    """Every gradient a parameter holds, ``.grad`` and ``main_grad``, in parameter order."""
    return [t for p in net.parameters() for t in (p.grad, getattr(p, "main_grad", None)) if t is not None]


@pytest.mark.parametrize("mode", ["grad", "main", "defer"])
@pytest.mark.parametrize("first_stage", [False, True], ids=["middle", "first"])
def test_functions_that_write_their_weight_grad_count_once(mode, first_stage):
    """Over two microbatches, I of both then W of both (as zero-bubble tables run them): each
    weight gradient once, whether the Function writes ``.grad`` or ``main_grad`` in I, or defers
    the work to W; on a first stage (no input gradient, so no I pass) W runs the Function alone."""
    _WritesGrad.mode = mode
    ref, split = _FuncNet(), _FuncNet()
    for net in (ref, split):
        for p in (net.w1, net.w2):
            p.main_grad = torch.zeros_like(p)
    xs = [torch.randn(3, 5, dtype=torch.float64) for _ in range(2)]
    gs = [torch.randn(3, 5, dtype=torch.float64) for _ in range(2)]
    for x, g in zip(xs, gs):
        ref(x if first_stage else x.clone().requires_grad_()).backward(g)
    pend = []
    for x, g in zip(xs, gs):
        xi = x if first_stage else x.clone().requires_grad_()
        pend.append(input_grad(xi, split(xi), split.parameters(), g)[1])
    if mode != "defer" and not first_stage:
        assert {id(p) for p in pend[0].written} == {id(split.w1), id(split.w2)}  # noted in I
    for pd in pend:
        weight_grad(pd)
    for a, b in zip(_grads(ref), _grads(split), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-13)


def test_defer_outside_a_split_backward_is_refused():
    with pytest.raises(ShardkitError, match="no split backward is running"):
        defer(lambda: None)
    assert not deferring()
