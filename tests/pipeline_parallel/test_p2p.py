"""Pipeline P2P transfers: coordinate-encoded, bitwise, for pp in {2, 3, 4}.

Each message carries a value that encodes (direction, sending stage, microbatch), so a message
delivered to the wrong stage, in the wrong order or with the wrong shape fails bitwise.
Microbatches change shape and ndim (a zero-size and a 0-d one included) to exercise negotiation;
static runs declare each shape on both ends.
"""

import pytest
import torch

from harness.checks import cotangent, world_sum
from harness.helpers import get_mesh, rank, subgroup, world_group, world_size
from shardkit.comm import CommLedger, checks
from shardkit.errors import ShardkitTypeError
from shardkit.pipeline_parallel import (
    P2PWork,
    recv_backward,
    recv_forward,
    send_backward,
    send_backward_recv_backward,
    send_backward_recv_forward,
    send_forward,
    send_forward_recv_backward,
    send_forward_recv_forward,
)

SHAPES = [(2, 3), (5,), (1, 2, 0, 3), (), (3, 1, 2, 2)]
DTYPES = ["float32", "float64", "bfloat16", "int64"]
FWD, BWD = 0, 1


def value(shape, dtype, direction, stage, mb):
    """Coordinate-encoded message: global index + 1000 * direction + 100 * stage + 10 * mb."""
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    return (base + 1000 * direction + 100 * stage + 10 * mb).to(dtype)


def _same(got, expected):
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


# ---------------------------------------------------------------- single transfers, chained


def _chain(dtype_name, static, batched, group=None):
    """Forward through every stage for all microbatches, then backward."""
    dtype, g, s, P = getattr(torch, dtype_name), group or world_group(), rank(), world_size()
    kw = dict(batched=batched)
    decl = (lambda shape: dict(shape=shape, dtype=dtype)) if static else (lambda shape: {})
    for m, shape in enumerate(SHAPES):
        if s > 0:
            assert _same(recv_forward(g, **decl(shape), **kw), value(shape, dtype, FWD, s - 1, m))
        if s < P - 1:
            assert send_forward(value(shape, dtype, FWD, s, m), g, **decl(shape), **kw) is None
    for m, shape in enumerate(SHAPES):
        if s < P - 1:
            assert _same(recv_backward(g, **decl(shape), **kw), value(shape, dtype, BWD, s + 1, m))
        if s > 0:
            send_backward(value(shape, dtype, BWD, s, m), g, **decl(shape), **kw)


_CHAIN = [
    pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"]),
    pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"]),
]


def _params(fn):
    for mark in reversed(_CHAIN):
        fn = mark(fn)
    return fn


@pytest.mark.world(2, timeout=20)
@_params
def test_chain_pp2(static, batched):
    for dtype in DTYPES:
        _chain(dtype, static, batched)


@pytest.mark.world(3, timeout=20)
@_params
def test_chain_pp3(static, batched):
    for dtype in DTYPES:
        _chain(dtype, static, batched)


@pytest.mark.world(4, timeout=20)
@_params
def test_chain_pp4(static, batched):
    for dtype in DTYPES:
        _chain(dtype, static, batched)


@pytest.mark.world(3, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_chain_with_checks_on_and_a_device_mesh(static):
    with checks(True):
        _chain("float32", static, batched=False, group=get_mesh((3,), ("pp",)))


# ---------------------------------------------------------------- 1F1B with the combined calls


def _one_f_one_b(static, batched, M=5):
    """Megatron's 1F1B communication pattern; stage compute is ``+ 1`` on activations and
    gradients, so stage s must receive ``x_m + s`` and the gradient ``g_m + (P - 1 - s)``."""
    g, s, P, dt = world_group(), rank(), world_size(), torch.float64
    first, last = s == 0, s == P - 1
    shapes = [(2, 3)] * M if static else [SHAPES[m % len(SHAPES)] for m in range(M)]
    kw = dict(batched=batched, **(dict(shape=shapes[0], dtype=dt) if static else {}))
    x_in = lambda m: value(shapes[m], dt, FWD, 0, m)  # noqa: E731  stage 0's input
    g_out = lambda m: value(shapes[m], dt, BWD, 0, m)  # noqa: E731  the last stage's loss gradient
    warm = min(P - s - 1, M)
    fm = bm = 0

    def got_x(x):
        assert _same(x, x_in(fm) + s), (s, fm)

    def got_g(gr):
        assert _same(gr, g_out(bm) + (P - 1 - s)), (s, bm)

    for _ in range(warm):
        x = x_in(fm) if first else recv_forward(g, **kw)
        got_x(x)
        send_forward(x + 1, g, **kw)
        fm += 1
    x = (x_in(fm) if first else recv_forward(g, **kw)) if M > warm else None
    for i in range(M - warm):
        got_x(x)
        gr = g_out(bm) if last else send_forward_recv_backward(x + 1, g, **kw)
        got_g(gr)
        fm += 1
        if i == M - warm - 1:
            if not first:
                send_backward(gr + 1, g, **kw)
        elif first:
            x = x_in(fm)
        else:
            x = send_backward_recv_forward(gr + 1, g, **kw)
        bm += 1
    for _ in range(warm):
        gr = recv_backward(g, **kw)
        got_g(gr)
        if not first:
            send_backward(gr + 1, g, **kw)
        bm += 1
    assert fm == bm == M


_1F1B = [
    pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"]),
    pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"]),
    pytest.mark.parametrize("checks_on", [False, True], ids=["", "checks"]),
]


def _params_1f1b(fn):
    for mark in reversed(_1F1B):
        fn = mark(fn)
    return fn


@pytest.mark.world(2, timeout=20)
@_params_1f1b
def test_1f1b_pp2(static, batched, checks_on):
    with checks(checks_on):
        _one_f_one_b(static, batched)


@pytest.mark.world(3, timeout=20)
@_params_1f1b
def test_1f1b_pp3(static, batched, checks_on):
    with checks(checks_on):
        _one_f_one_b(static, batched)


@pytest.mark.world(4, timeout=20)
@_params_1f1b
def test_1f1b_pp4(static, batched, checks_on):
    with checks(checks_on):
        _one_f_one_b(static, batched)


# ---------------------------------------------------------------- loop (last stage feeds the first)


def _loop(static, batched):
    g, s, P, dt = world_group(), rank(), world_size(), torch.float32
    kw = dict(batched=batched, loop=True)
    for m, shape in enumerate(SHAPES):
        kw_m = dict(kw, **(dict(shape=shape, dtype=dt) if static else {}))
        x = send_forward_recv_forward(value(shape, dt, FWD, s, m), g, **kw_m)  # ring shift forward
        assert _same(x, value(shape, dt, FWD, (s - 1) % P, m))
        y = send_backward_recv_backward(value(shape, dt, BWD, s, m), g, **kw_m)  # and back
        assert _same(y, value(shape, dt, BWD, (s + 1) % P, m))
    # The single calls across the wrap: last -> first forward, first -> last backward.
    if s == P - 1:
        send_forward(value((4,), dt, FWD, s, 9), g, **kw)
        assert _same(recv_backward(g, **kw), value((4,), dt, BWD, 0, 9))
    if s == 0:
        assert _same(recv_forward(g, **kw), value((4,), dt, FWD, P - 1, 9))
        send_backward(value((4,), dt, BWD, 0, 9), g, **kw)


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
@pytest.mark.parametrize("checks_on", [False, True], ids=["", "checks"])
def test_loop_pp2(static, batched, checks_on):
    """pp=2 with loop: prev == next, so forward data, backward data and the verdicts of both
    share one pair of ranks and pair by FIFO order alone."""
    with checks(checks_on):
        _loop(static, batched)


@pytest.mark.world(3, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
def test_loop_pp3(static, batched):
    _loop(static, batched)


@pytest.mark.world(4, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
def test_loop_pp4(static, batched):
    with checks(True):
        _loop(static, batched)


# ---------------------------------------------------------------- async


def _async(static, batched):
    """Every stage posts all its receives for the microbatches first, then forwards each as it
    completes with async sends, waited at the end; the same backward."""
    g, s, P, dt = world_group(), rank(), world_size(), torch.float64
    decl = (lambda m: dict(shape=SHAPES[m], dtype=dt)) if static else (lambda m: {})
    M = len(SHAPES)
    for direction, src, has_src, has_dst, recv, send in (
        (FWD, s - 1, s > 0, s < P - 1, recv_forward, send_forward),
        (BWD, s + 1, s < P - 1, s > 0, recv_backward, send_backward),
    ):
        recvs = [recv(g, async_op=True, batched=batched, **decl(m)) for m in range(M)] if has_src else None
        sends = []
        for m in range(M):
            if has_src:
                got = recvs[m].wait()
                assert _same(got, value(SHAPES[m], dt, direction, src, m))
                assert recvs[m].is_completed() and recvs[m].wait() is got  # idempotent
            if has_dst:
                sends.append(send(value(SHAPES[m], dt, direction, s, m), g, async_op=True, batched=batched, **decl(m)))
        assert all(isinstance(h, P2PWork) and h.wait() is None for h in sends)


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
def test_async_pp2(static, batched):
    _async(static, batched)


@pytest.mark.world(3, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_async_pp3(static):
    _async(static, batched=False)


@pytest.mark.world(4, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_async_pp4(static):
    _async(static, batched=True)


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
def test_async_combined_call_against_single_calls_pp2(static, batched):
    """A combined call may face the two single calls on its peer, except in batched mode with
    dynamic shapes: there it posts its payload only once all its headers arrived, so the peer
    must make the mirror combined call (as 1F1B does)."""
    g, s = world_group(), rank()
    kw = dict(batched=batched, **(dict(shape=(3, 2), dtype=torch.float32) if static else {}))
    x, y = value((3, 2), torch.float32, FWD, 0, 0), value((3, 2), torch.float32, BWD, 1, 0)
    if s == 0:
        h = send_forward_recv_backward(x, g, async_op=True, **kw)
        assert _same(h.wait(), y)
    elif batched and not static:
        assert _same(send_backward_recv_forward(y, g, async_op=True, **kw).wait(), x)
    else:
        assert _same(recv_forward(g, **kw), x)
        assert send_backward(y, g, async_op=True, **kw).wait() is None
    # and the other way round: stage 1 combined, stage 0 single calls
    if s == 1:
        assert _same(send_backward_recv_forward(y, g, **kw), x)
    elif batched and not static:
        assert _same(send_forward_recv_backward(x, g, **kw), y)
    else:
        send_forward(x, g, **kw)
        assert _same(recv_backward(g, **kw), y)


# ---------------------------------------------------------------- adjoint


def _adjoint(batched, combined):
    """A moves x from stage s to s + 1, B moves y from s + 1 to s: sum <A x, y> == sum <x, B y>."""
    g, s, P = world_group(), rank(), world_size()
    x, y = cotangent((2, 3, 4)).unbind(0)  # independent random x and y, different per rank
    kw = dict(batched=batched)
    if combined:  # the 1F1B pair of calls, mirrored on the two ends of each link
        ax = send_backward_recv_forward(y, g, **kw) if s > 0 else None
        by = send_forward_recv_backward(x, g, **kw) if s < P - 1 else None
    else:
        ax = recv_forward(g, **kw) if s > 0 else None
        if s < P - 1:
            send_forward(x, g, **kw)
            by = recv_backward(g, **kw)
        if s > 0:
            send_backward(y, g, **kw)
    lhs = float((ax * y).sum()) if s > 0 else 0.0
    rhs = float((x * by).sum()) if s < P - 1 else 0.0
    lhs, rhs = world_sum([lhs, rhs])
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), abs(rhs)), (lhs, rhs)


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
@pytest.mark.parametrize("combined", [False, True], ids=["pair", "combined"])
def test_adjoint_pp2(batched, combined):
    _adjoint(batched, combined)


@pytest.mark.world(3, timeout=20)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
@pytest.mark.parametrize("combined", [False, True], ids=["pair", "combined"])
def test_adjoint_pp3(batched, combined):
    _adjoint(batched, combined)


@pytest.mark.world(4, timeout=20)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
@pytest.mark.parametrize("combined", [False, True], ids=["pair", "combined"])
def test_adjoint_pp4(batched, combined):
    _adjoint(batched, combined)


# ---------------------------------------------------------------- several pipeline groups


@pytest.mark.world(3, timeout=20)
@pytest.mark.parametrize("batched", [False, True], ids=["ordered", "batched"])
def test_fan_in_mean_and_its_adjoint(batched):
    """Stage 2 follows both 0 and 1 (groups (0, 2) and (1, 2)): recv_forward averages, and
    sending y / K back is its adjoint."""
    groups = [subgroup((0, 2)), subgroup((1, 2))]
    x, y = cotangent((2, 2, 5)).unbind(0)
    if rank() < 2:
        send_forward(x, groups[rank()], batched=batched)
        by = recv_backward(groups[rank()], batched=batched)
    else:
        ax = recv_forward(groups, batched=batched)
        send_backward(y / 2, groups, batched=batched)
    xs = [None] * 3
    torch.distributed.all_gather_object(xs, x)
    if rank() == 2:
        assert torch.equal(ax, (xs[0] + xs[1]) / 2)
    lhs = float((ax * y).sum()) if rank() == 2 else 0.0
    rhs = float((x * by).sum()) if rank() < 2 else 0.0
    lhs, rhs = world_sum([lhs, rhs])
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), abs(rhs)), (lhs, rhs)


@pytest.mark.world(3, timeout=20)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fan_out_and_sum(static):
    """Stage 0 precedes both 1 and 2 (groups (0, 1) and (0, 2)): the same tensor goes to both,
    and the gradients come back summed (the adjoint); bf16 is accumulated in float32."""
    groups = [subgroup((0, 1)), subgroup((0, 2))]
    dt = torch.bfloat16
    decl = dict(shape=(2, 3), dtype=dt) if static else {}
    x = value((2, 3), dt, FWD, 0, 0)
    if rank() == 0:
        send_forward(x, groups, **decl)
        total = recv_backward(groups, reduce="sum", **decl)
        expected = (value((2, 3), dt, BWD, 1, 0).float() + value((2, 3), dt, BWD, 2, 0).float()).to(dt)
        assert _same(total, expected)
    else:
        assert _same(recv_forward(groups[rank() - 1], **decl), x)
        send_backward(value((2, 3), dt, BWD, rank(), 0), groups[rank() - 1], **decl)


@pytest.mark.world(3, timeout=20)
def test_fan_in_mean_of_integers_raises_after_receiving():
    groups = [subgroup((0, 2)), subgroup((1, 2))]
    if rank() < 2:
        send_forward(torch.arange(4), groups[rank()])
    else:
        with pytest.raises(ShardkitTypeError, match="floating dtype"):
            recv_forward(groups)
    # The channels are clean: a second round arrives intact.
    if rank() < 2:
        send_forward(torch.arange(4) + rank(), groups[rank()])
    else:
        assert torch.equal(recv_forward(groups, reduce="sum"), torch.arange(4) * 2 + 1)


# ---------------------------------------------------------------- ledger


@pytest.mark.world(2, timeout=20)
@pytest.mark.parametrize("mode", ["dynamic", "static", "checks_static", "checks_dynamic"])
def test_ledger_counts_every_message(mode):
    g, s = world_group(), rank()
    x = value((2, 3), torch.float32, FWD, 0, 0)  # 24 bytes; a header is 20 int64 = 160 bytes
    decl = dict(shape=(2, 3), dtype=torch.float32) if "static" in mode else {}
    with checks(mode.startswith("checks")), CommLedger() as ledger:
        if s == 0:
            send_forward(x, g, **decl)
            recv_backward(g, **decl)
        else:
            recv_forward(g, **decl)
            send_backward(x, g, **decl)
    mine, theirs = ("send", "recv") if s == 0 else ("recv", "send")
    fwd_api, bwd_api = ("send_forward", "recv_backward") if s == 0 else ("recv_forward", "send_backward")
    header = 1 if mode == "dynamic" else 0
    checked = mode.startswith("checks")
    # Payload always; the header is forward/backward traffic when dynamic. With checks, each end
    # sends and receives one hello per transfer instead (28 int64 = 224 bytes, phase "check"):
    # it carries the header, so there is no other.
    assert ledger.count(op=mine, api=fwd_api, phase="forward") == 1 + header
    assert ledger.count(op=theirs, api=bwd_api, phase="backward") == 1 + header
    assert ledger.count(phase="check") == (4 if checked else 0)
    assert ledger.count() == 2 * (1 + header + 2 * checked)
    sent = ledger.bytes_sent(phase="forward") + ledger.bytes_sent(phase="backward")
    received = ledger.bytes_received(phase="forward") + ledger.bytes_received(phase="backward")
    assert sent == received == 24 + 160 * header
    assert ledger.bytes_sent(phase="check") == ledger.bytes_received(phase="check") == 2 * 224 * checked


@pytest.mark.world(2, timeout=20)
def test_ledger_combined_call_and_zero_size_payload():
    g, s = world_group(), rank()
    with CommLedger() as ledger:
        if s == 0:
            gr = send_forward_recv_backward(torch.zeros(0, 4), g)
            assert gr.shape == (3,)
        else:
            assert recv_forward(g).shape == (0, 4)
            send_backward(torch.ones(3, dtype=torch.float64), g)
    api = "send_forward_recv_backward" if s == 0 else None
    if s == 0:
        assert ledger.count(api=api, op="send", phase="forward") == 1  # header only: no empty payload
        assert ledger.count(api=api, op="recv", phase="backward") == 2
        assert ledger.bytes_received() == 160 + 24
    else:
        assert ledger.count(op="recv") == 1 and ledger.count(op="send") == 2
    assert ledger.count() == 3
