"""Eval / forward-only runs of every schedule (``run_schedule(..., train=False)`` or under
``torch.no_grad()``), the returned outputs and ``scale_grads``.

Every rank builds the full float64 MLP from one seed and keeps its chunks; the rank holding the
last chunk compares its losses and outputs bitwise with one process's forward of the same
microbatches (the same layers on the same inputs: the same floats). Forward-only tables are
checked by both simulators and the NCCL stream model first (pure).
"""

import copy

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from harness.pipe_models import mlp_chunks, mse, tanh_mlp
from harness.stream_model import check_streams, posting_order
from shardkit.comm import CommLedger
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import PipelineStage, run_schedule
from shardkit.pipeline_parallel.simulate import simulate_steps
from shardkit.pipeline_parallel.steps import forward_only
from shardkit.pipeline_parallel.tables import SCHEDULES

H, LAYERS = 4, 9
CASES = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2)]
CASES += [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 2)]
SPLIT = [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 2)]  # the tables with I steps


def _model():
    return tanh_mlp(H, LAYERS, seed=4321)


def _chunks(model, p, v, placement, r):
    return mlp_chunks(model, LAYERS, p, v, placement, r)


def _data(m):
    gen = torch.Generator().manual_seed(7)
    lens = [2 + j % 3 for j in range(m)]  # microbatches of different lengths: shapes negotiated
    xs = [torch.randn(2, s, H, generator=gen, dtype=torch.float64) for s in lens]
    ts = [torch.randn(2, s, H, generator=gen, dtype=torch.float64) for s in lens]
    return xs, ts


def _stage(name, v, full):
    placement = SCHEDULES[name].placement
    mine = copy.deepcopy(_chunks(full, world_size(), v, placement, rank()))
    return PipelineStage(mine, world_group(), placement=placement, loss_fn=mse), mine


def _tables():
    for name, spec in SCHEDULES.items():
        for p in range(2, 7):
            for v in range(spec.v_min, min(spec.v_max or 3, 3) + 1):
                for m in (p, 2 * p, 2 * p + 1):
                    try:
                        yield (name, p, v, m), spec.build(p, v, m), spec.placement
                    except ShardkitError:  # sizes the schedule refuses
                        continue


def test_forward_only_tables_run_in_every_simulator():
    """Each table's forward-only rows: complete and deadlock-free in the dataflow simulator and
    the stream model of NCCL (pair and rank streams, one group per link) and gloo (early
    receives, one group)."""
    failures, n = [], 0
    for case, table, placement in _tables():
        fwd = forward_only(table)
        assert all(s.kind == "F" for row in fwd for s in row) and sum(map(len, fwd)) == case[2] * case[3] * case[1]
        n += 1
        rep = simulate_steps(fwd, placement=placement, v=case[2], num_microbatches=case[3])
        if rep.error is not None:
            failures.append((case, "steps", rep.error))
        for early, shared, gran in ((False, False, "pair"), (False, False, "rank"), (True, True, "gloo")):
            events = posting_order(fwd, placement=placement, v=case[2], early=early, shared=shared)
            if (err := check_streams(events, gran)) is not None:
                failures.append((case, gran, err[:200]))
    assert n > 100 and not failures, failures[:3]


def test_a_table_mixing_forward_only_and_full_rows_is_refused():
    table = SCHEDULES["1f1b"].build(2, 1, 2)
    mixed = (forward_only(table)[0], table[1])
    rep = simulate_steps(mixed, num_microbatches=2)
    assert rep.error is not None and "expected F+B or F+I+W" in rep.error


def _eval_parity(name, v, m, **kw):
    """One eval call: losses and outputs bitwise equal to one process's forward; no gradient."""
    p = world_size()
    full = _model()
    xs, ts = _data(m)
    with torch.no_grad():
        ref_out = [full(x) for x in xs]
        ref_loss = [mse(y, t) for y, t in zip(ref_out, ts)]
    stage, mine = _stage(name, v, full)
    with CommLedger() as ledger:
        got = run_schedule(stage, name, xs, ts, num_microbatches=m, return_outputs=True, **kw)
    ok = all(q.grad is None for mod in mine for q in mod.parameters())
    ok &= ledger.count(op="send", phase="backward") == 0  # no gradient message
    if stage.holds(p * v - 1):
        ok &= all(torch.equal(a, b) for a, b in zip(got.losses, ref_loss)) and len(got.losses) == m
        ok &= all(torch.equal(a, b) for a, b in zip(got.outputs, ref_out)) and len(got.outputs) == m
    else:
        ok &= got.losses is None and got.outputs is None
    return ok


@pytest.mark.world(2, timeout=90)
@pytest.mark.parametrize(("name", "v"), CASES)
def test_eval_every_schedule_p2_train_false(name, v):
    assert all_true(_eval_parity(name, v, m=4, train=False)), (name, rank())


@pytest.mark.world(4, timeout=120)
@pytest.mark.parametrize(("name", "v"), CASES)
def test_eval_every_schedule_p4_under_no_grad(name, v):
    with torch.no_grad():
        ok = _eval_parity(name, v, m=8)
    assert all_true(ok), (name, rank())


@pytest.mark.world(2, timeout=90)
@pytest.mark.parametrize(("name", "v"), SPLIT)
def test_no_grad_on_i_w_tables_runs_where_it_used_to_hang(name, v):
    """Issue 30: under ``torch.no_grad()`` a zero-bubble table ran its I steps: the rank whose
    I came first raised inside ``input_grad`` ("element 0 of tensors does not require grad")
    while its peer blocked in a receive. Now the call is forward-only: no I step runs (the
    runner's input_grad is never reached) and the losses are the forward's."""
    import shardkit.pipeline_parallel._chunk_exec as ex

    calls = []
    real = ex.input_grad
    ex.input_grad = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        full = _model()
        xs, ts = _data(4)
        stage, _ = _stage(name, v, full)
        with torch.no_grad():
            losses = run_schedule(stage, name, xs, ts, num_microbatches=4)
            ref = [mse(full(x), t) for x, t in zip(xs, ts)]
    finally:
        ex.input_grad = real
    ok = not calls
    if stage.holds(2 * v - 1):
        ok &= all(torch.equal(a, b) for a, b in zip(losses, ref))
    assert all_true(ok)


@pytest.mark.world(2, timeout=90)
def test_eval_then_train_on_one_stage_keeps_training_exact():
    """Alternating eval and train calls on one stage (the trainer's --eval-every): each train
    call equals backprop of the mean (scale_grads=True) or the sum (False) of the losses."""
    full = _model()
    xs, ts = _data(4)
    stage, mine = _stage("zbv", 2, full)
    ok = True
    for scale in (True, False, True):
        run_schedule(stage, "zbv", xs, ts, num_microbatches=4, train=False)
        for mod in mine:
            mod.zero_grad()
        full.zero_grad()
        total = sum(mse(full(x), t) for x, t in zip(xs, ts))
        (total / 4 if scale else total).backward()
        run_schedule(stage, "zbv", xs, ts, num_microbatches=4, scale_grads=scale)
        for mod, ref in zip(mine, _chunks(full, 2, 2, "v", rank()), strict=True):
            for a, b in zip(mod.parameters(), ref.parameters(), strict=True):
                ok &= a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert all_true(ok)


@pytest.mark.world(2, timeout=90)
def test_one_chunk_stage_eval_outputs_and_scale_grads():
    """The one-chunk runner (PipelineStage): eval returns outputs and losses and sends no
    gradient; train with scale_grads=False gives the gradients of the summed losses."""
    r = rank()
    full = _model()
    xs, ts = _data(4)
    layers = _chunks(full, 2, 1, "looped", r)[0]
    stage = PipelineStage(copy.deepcopy(layers), world_group(), r, 2, loss_fn=mse if r == 1 else None)
    with torch.no_grad():
        got = run_schedule(stage, "1f1b", xs, ts, num_microbatches=4, return_outputs=True)
        ref_out = [full(x) for x in xs]
    ok = all(q.grad is None for q in stage.module.parameters())
    if r == 1:
        ok &= all(torch.equal(a, b) for a, b in zip(got.outputs, ref_out))
        ok &= all(torch.equal(a, mse(y, t)) for a, y, t in zip(got.losses, ref_out, ts))
    else:
        ok &= got == (None, None)
    full.zero_grad()
    sum(mse(full(x), t) for x, t in zip(xs, ts)).backward()
    out = run_schedule(stage, "1f1b", xs, ts, num_microbatches=4, scale_grads=False)
    ok &= (out is None) == (r == 0)
    for a, b in zip(stage.module.parameters(), layers.parameters(), strict=True):
        ok &= torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    # inference without targets: outputs only, losses None
    got = run_schedule(stage, "1f1b", xs, None, num_microbatches=4, train=False, return_outputs=True)
    ok &= got.losses is None and (r == 0 or all(torch.equal(a, b) for a, b in zip(got.outputs, ref_out)))
    assert all_true(ok)


@pytest.mark.world(2, timeout=90)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "one-chunk"])
def test_modes_that_cannot_run_are_refused_on_every_rank(chunked):
    r = rank()
    full = _model()
    xs, ts = _data(2)
    if chunked:
        stage, _ = _stage("zbv", 2, full)
        name, last = "zbv", r == 0
    else:
        layers = copy.deepcopy(_chunks(full, 2, 1, "looped", r)[0])
        stage, name, last = PipelineStage(layers, world_group(), r, 2, loss_fn=mse if r == 1 else None), "1f1b", r == 1
    with torch.no_grad(), pytest.raises(ShardkitError, match=r"train=True under torch.no_grad\(\)"):
        run_schedule(stage, name, xs, ts, num_microbatches=2, train=True)
    with pytest.raises(ShardkitError, match="another schedule table|run with train="):
        with torch.set_grad_enabled(r == 0):  # one rank under no_grad beside a training one
            run_schedule(stage, name, xs, ts, num_microbatches=2)
    with pytest.raises(ShardkitError, match="scale_grads must be a bool"):
        run_schedule(stage, name, xs, ts, num_microbatches=2, scale_grads=1 if r == 1 else True)
    with pytest.raises(ShardkitError, match="needs 2 targets_microbatches"):  # eval with nothing to return
        run_schedule(stage, name, xs, None if last else ts, num_microbatches=2, train=False)
    out = run_schedule(stage, name, xs, ts, num_microbatches=2, return_outputs=False)  # still runs after
    assert all_true((out is not None) == last)


class _Flagged(nn.Module):
    """A chunk whose call mixes the tensor with non-tensor arguments (a bool and a float)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, *, negate: bool, scale: float):
        y = self.inner(x) * scale
        return -y if negate else y


@pytest.mark.world(2, timeout=90)
@pytest.mark.parametrize("train", [True, False])
def test_non_tensor_arguments_per_microbatch_reach_every_chunk(train):
    """Non-tensor arguments (flags) go with each microbatch as ``stage_kwargs`` (every chunk's
    call gets them; they are not sent): zbv with a flag that differs per microbatch."""
    r = rank()
    full = _model()
    xs, ts = _data(4)
    kws = [{"negate": j % 2 == 1, "scale": 0.5 + j} for j in range(4)]
    mine = [_Flagged(copy.deepcopy(c)) for c in _chunks(full, 2, 2, "v", r)]
    ref = [_Flagged(c) for c in _chunks(full, 1, 4, "looped", 0)]

    def ref_forward(x, kw):
        for mod in ref:
            x = mod(x, **kw)
        return x

    stage = PipelineStage(mine, world_group(), loss_fn=mse, placement="v")
    with torch.set_grad_enabled(train):
        losses = run_schedule(stage, "zbv", xs, ts, num_microbatches=4, stage_kwargs=kws, scale_grads=False)
        want = [mse(ref_forward(x, kw), t) for x, kw, t in zip(xs, kws, ts)]
    ok = losses is None if r == 1 else all(torch.equal(a, b.detach()) for a, b in zip(losses, want))
    if train:
        sum(want).backward()
        mods = [m.inner for m in ref]
        for mod, g in zip(mine, (0, 3) if r == 0 else (1, 2), strict=True):
            for a, b in zip(mod.parameters(), mods[g].parameters(), strict=True):
                ok &= torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert all_true(ok)
