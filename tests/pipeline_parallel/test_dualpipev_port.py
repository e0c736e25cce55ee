"""DualPipe's own example (``examples/example_dualpipev.py``, deepseek-ai/DualPipe), ported onto
shardkit's runner (our code; the facts carried over: the model, the checks and their bounds).

The model: ``2p`` blocks ``Linear(H, 4H) -> GELU -> Linear(4H, H)`` without biases, every linear a
custom autograd Function whose backward adds the weight gradient into ``weight.grad`` itself and
returns None for the weight (or, here, defers that closure to ``W`` when
:func:`~shardkit.pipeline_parallel.weight_defer.deferring` says so: DualPipe's pattern). Rank
``r`` holds blocks ``r`` and ``2p - 1 - r`` (the V placement). The reference runs each microbatch
through the whole model and calls ``loss.backward()`` per microbatch (a sum: ``scale_grads=False``).
The checks, as the source's: losses bitwise equal; every gradient within a cosine distance of
``1e-13`` of the reference (here float64, and also ``allclose`` at 1e-12); the inference step (under
``torch.no_grad()``, outputs returned): losses and outputs bitwise equal.

Also here: the same Function writing its gradient directly in ``I`` (no deferral), the issue's
case of a double-counted weight gradient (zbv, p = 1, M = 2: ratios were ``[1.0, 2.0]``), and a
chunk whose parameters accumulate through post-accumulate-grad hooks (run as ``B``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from shardkit.pipeline_parallel import PipelineStage, run_schedule
from shardkit.pipeline_parallel.weight_defer import defer, deferring

H, MB, SEQ = 8, 3, 4  # the source: hidden 512, micro-batch 3, sequence 256 (on GPUs)


class _LinearFunc(torch.autograd.Function):
    """``x @ w.T``; the backward adds ``w``'s gradient into ``w.grad`` (deferred to W if asked)."""

    use_defer = True

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        if w.grad is None:
            w.grad = torch.zeros_like(w)

        def add_weight_grad():
            w.grad += gy.flatten(0, -2).T @ x.flatten(0, -2)

        if _LinearFunc.use_defer and deferring():
            defer(add_weight_grad)
        else:
            add_weight_grad()
        return gy @ w, None


class _FuncLinear(nn.Linear):
    def forward(self, x):
        return _LinearFunc.apply(x, self.weight)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = _FuncLinear(H, 4 * H, bias=False, dtype=torch.float64)
        self.linear2 = _FuncLinear(4 * H, H, bias=False, dtype=torch.float64)

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(x)))


def _criterion(out, target):
    return F.mse_loss(out, target).clone()


def _cos_diff(a, b):
    return 1 - 2 * (a * b).sum().item() / (a * a + b * b).sum().item()


def _setup(p, m):
    torch.manual_seed(233)
    full = nn.Sequential(*[_Block() for _ in range(2 * p)])
    x = torch.randn(m * MB, SEQ, H, dtype=torch.float64)
    t = torch.randn(m * MB, SEQ, H, dtype=torch.float64)
    return full, x, t


def _reference(full, x, t, m):
    ys, losses = [], []
    for xm, tm in zip(x.chunk(m), t.chunk(m)):
        y = full(xm)
        loss = _criterion(y, tm)
        loss.backward()
        ys.append(y.detach())
        losses.append(loss.detach())
    return torch.stack(losses), torch.cat(ys)


def _local(full, p, r):
    mine = [_Block(), _Block()]
    mine[0].load_state_dict(full[r].state_dict())
    mine[1].load_state_dict(full[2 * p - 1 - r].state_dict())
    return mine


def _port(schedule, m, use_defer):
    r, p = rank(), world_size()
    _LinearFunc.use_defer = use_defer
    full, x, t = _setup(p, m)
    loss_ref, out_ref = _reference(full, x, t, m)
    mine = _local(full, p, r)
    stage = PipelineStage(mine, world_group(), loss_fn=_criterion, placement="v")
    xs, ts = list(x.chunk(m)), list(t.chunk(m))
    # training step: the sum of the microbatch losses, as the source
    losses = run_schedule(stage, schedule, xs, ts, num_microbatches=m, scale_grads=False)
    ok = torch.equal(torch.stack(losses), loss_ref) if r == 0 else losses is None
    refs = [full[r], full[2 * p - 1 - r]]
    for mod, ref in zip(mine, refs, strict=True):
        for a, b in zip(mod.parameters(), ref.parameters(), strict=True):
            ok &= _cos_diff(a.grad, b.grad) < 1e-13 and torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    for mod in mine:
        mod.zero_grad()
    # inference step
    with torch.no_grad():
        got = run_schedule(stage, schedule, xs, ts, num_microbatches=m, return_outputs=True)
    if r == 0:
        ok &= torch.equal(torch.stack(got.losses), loss_ref) and torch.equal(torch.cat(got.outputs), out_ref)
    else:
        ok &= got.losses is None and got.outputs is None
    ok &= all(q.grad is None for mod in mine for q in mod.parameters())
    return ok


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
@pytest.mark.parametrize("use_defer", [True, False], ids=["deferred", "written-in-I"])
def test_example_dualpipev_pp2(schedule, use_defer):
    assert all_true(_port(schedule, 10, use_defer)), (schedule, rank())


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
@pytest.mark.parametrize("use_defer", [True, False], ids=["deferred", "written-in-I"])
def test_example_dualpipev_pp4(schedule, use_defer):
    assert all_true(_port(schedule, 10, use_defer)), (schedule, rank())


@pytest.mark.world(1, timeout=60)
@pytest.mark.parametrize("use_defer", [True, False], ids=["deferred", "written-in-I"])
def test_issue_case_zbv_p1_m2_counts_each_weight_gradient_once(use_defer):
    """The issue's reproduction: zbv on one rank, two microbatches. Each chunk's gradient over the
    reference's was 1.0 and 2.0 (the I step's write counted again by W); now 1.0 and 1.0."""
    _LinearFunc.use_defer = use_defer
    full, x, t = _setup(1, 2)
    _reference(full, x, t, 2)
    mine = _local(full, 1, 0)
    stage = PipelineStage(mine, world_group(), loss_fn=_criterion, placement="v")
    run_schedule(stage, "zbv", list(x.chunk(2)), list(t.chunk(2)), num_microbatches=2, scale_grads=False)
    ratios = [
        (a.grad.norm() / b.grad.norm()).item()
        for mod, ref in zip(mine, [full[0], full[1]], strict=True)
        for a, b in zip(mod.parameters(), ref.parameters(), strict=True)
    ]
    assert ratios == pytest.approx([1.0] * 4, abs=1e-12), ratios


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_post_accumulate_hooks_run_as_b_and_stay_exact(schedule):
    """Parameters whose gradient goes to ``main_grad`` through a post-accumulate-grad hook (and
    whose ``.grad`` is then dropped, as Megatron-style fused buffers do): the split's ``W`` adds
    gradients without autograd's accumulation, so the hooks would never fire; such a chunk runs
    its ``I`` as ``B``. ``main_grad`` equals the reference's (plain ``nn.Linear`` layers)."""
    r, p, m = rank(), world_size(), 4
    torch.manual_seed(5)
    full = nn.Sequential(*[nn.Sequential(nn.Linear(H, H, dtype=torch.float64), nn.Tanh()) for _ in range(2 * p)])
    x = torch.randn(m * 2, H, dtype=torch.float64)
    t = torch.randn(m * 2, H, dtype=torch.float64)
    mine = [nn.Sequential(nn.Linear(H, H, dtype=torch.float64), nn.Tanh()) for _ in range(2)]
    mine[0].load_state_dict(full[r].state_dict())
    mine[1].load_state_dict(full[2 * p - 1 - r].state_dict())

    def to_main(q):
        q.main_grad.add_(q.grad)
        q.grad = None

    for q in [*full.parameters(), *(q for mod in mine for q in mod.parameters())]:
        q.main_grad = torch.zeros_like(q)
        q.register_post_accumulate_grad_hook(to_main)
    for xm, tm in zip(x.chunk(m), t.chunk(m)):
        _criterion(full(xm), tm).backward()
    stage = PipelineStage(mine, world_group(), loss_fn=_criterion, placement="v")
    run_schedule(stage, schedule, list(x.chunk(m)), list(t.chunk(m)), num_microbatches=m, scale_grads=False)
    ok = True
    for mod, ref in zip(mine, [full[r], full[2 * p - 1 - r]], strict=True):
        for a, b in zip(mod.parameters(), ref.parameters(), strict=True):
            ok &= a.grad is None and torch.allclose(a.main_grad, b.main_grad, rtol=1e-12, atol=1e-12)
    assert all_true(ok)
