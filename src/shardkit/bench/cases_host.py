"""Host overhead per call: each public op against the bare c10d call it makes, on torch's fake
process group (issue 24): the collectives, Megatron's f/g, split/gather, all_to_all, halo
exchange and static pipeline send/recv (rank 0 of ``R``: it sends to and receives from rank 1).

The fake backend (``init_process_group("fake", ...)``, one process pretending to be rank 0 of
``R``) returns from every collective at once without moving data, so the time of a call is the
Python and dispatcher time around it: what the wrapper adds to the c10d call is the difference
between the two. Variants of one op, timed in the same rounds (``CALLS`` calls in a row per
round, reported per call):

- ``bare``: the c10d call(s) the op makes, on preallocated buffers;
- ``shardkit``: the public op, no gradient, flight recorder off, no ledger, check mode off;
- ``recorder`` / ``ledger`` / ``checks``: the same with one of them on: their own cost is the
  difference to ``shardkit``; the flight recorder is on by default in a process, so
  ``recorder`` is what a plain call costs (``default-bare``, held to the same goal);
- ``fwd+bwd`` against ``bare fwd+bwd``: the op on an input that requires grad and its backward,
  against the forward and backward c10d calls, bare; and against ``floor fwd+bwd``, the same
  bare calls inside the smallest autograd Function (what autograd itself costs: the part of
  ``fwd+bwd`` that no wrapper can remove).

The fake backend writes nothing into outputs, so the data cannot be checked; what is checked
before timing is that the op issues exactly the c10d calls its ``bare`` variant times (same
primitive, same buffer sizes and split sizes, through a spy) and returns the expected shape.
The check mode's metadata all-gather is answered as if every rank agreed (its table filled with
this rank's row, one small copy counted in the check mode's cost).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import all_gather, all_to_all, reduce_scatter
from ..comm import (
    CommLedger,
    FlightRecorder,
    _c10d,
    _compat,
    all_reduce_backward,
    all_reduce_forward,
    checks,
    gather_forward_split_backward,
    set_flight_recorder,
    split_forward_gather_backward,
)
from ..pipeline_parallel import recv_backward, send_forward
from ..spatial import halo_exchange
from ._method import Record, Settings, agree, time_interleaved

__all__ = ["host_overhead", "OPS"]

# Goals in microseconds above the bare call (issue 24's table); ops without one are reported only.
GOALS = {"all_gather": 25.0, "all_to_all": 30.0}
_SPIED = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


@contextlib.contextmanager
def _spy(calls: list):
    """Record ``(primitive, numel of each tensor argument, split sizes)`` of every c10d call
    made through ``dist`` or through the names the comm layer bound at import."""

    bound = [(mod, name) for mod in (_compat, _c10d) for name in ("all_gather_single", "reduce_scatter_single")]
    targets = [(dist, name) for name in _SPIED if hasattr(dist, name)] + bound
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]

    def wrap(fn, name):
        def spy(*args, **kwargs):
            numels = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            splits = [list(a) for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))]
            calls.append((name, numels, splits))
            return fn(*args, **kwargs)

        return spy

    seen: dict = {}
    for mod, name, fn in saved:
        setattr(mod, name, seen.setdefault(id(fn), wrap(fn, name)))
    try:
        yield calls
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def _agreeing():
    """Check mode on, its metadata all-gather answered as if every rank sent this rank's row."""
    mod = importlib.import_module("shardkit.comm.checks")  # (the package exports the function under that name)
    original = mod.all_gather_single

    def echo(out, inp, group=None, async_op=False):
        work = original(out, inp, group=group, async_op=async_op)
        out.view(-1, inp.numel()).copy_(inp.view(1, -1))
        return work

    mod.all_gather_single = echo
    try:
        with checks(True):
            yield
    finally:
        mod.all_gather_single = original


class Op(NamedTuple):
    """One measured op: ``fn(x)`` and the bare c10d call(s) of its forward and backward (None: none)."""

    label: str
    fn: Callable
    x: torch.Tensor
    bare_fwd: Callable | None
    bare_bwd: Callable | None
    grad: bool = True  # an autograd op (fwd+bwd measured); P2P functions are not
    checks: bool = True  # the check mode measurable here (P2P's checks read a peer's hello: no data on a fake group)


def _ops(pg, dev: torch.device | str = "cpu") -> dict[str, Op]:

    r = pg.size()
    ag = torch.randn(16, 64, device=dev)  # 4 KiB, the all_gather size
    ag_out = torch.empty(16 * r, 64, device=dev)
    rs_in = torch.randn(16 * r, 64, device=dev)
    rs_out = torch.empty(16, 64, device=dev)
    ar = torch.randn(16, 64, device=dev)
    ar_buf = torch.empty_like(ar)
    a2a = torch.randn(1, 64, 16, 8, device=dev)  # [B, S / R, N, D]: scatter heads, gather sequence
    a2a_send, a2a_recv = torch.empty(a2a.numel(), device=dev), torch.empty(a2a.numel(), device=dev)
    splits = [a2a.numel() // r] * r
    halo = torch.randn(1, 8, 32, device=dev)  # [B, C, L / R]: one element each side; rank 0's left: zeros
    halo_splits = [0, 8] + [0] * (r - 2)  # 8 channels to and from rank 1
    halo_send, halo_recv = torch.empty(8, device=dev), torch.empty(8, device=dev)
    p2p_buf = torch.empty(16, 64, device=dev)

    def ar_call():
        return dist.all_reduce(ar_buf, group=pg)

    def ag_call():
        return _compat.all_gather_single(ag_out, ag, group=pg)

    def rs_call():
        return _compat.reduce_scatter_single(rs_out, rs_in, group=pg)

    def a2a_call():
        return dist.all_to_all_single(a2a_recv, a2a_send, splits, splits, group=pg)

    def halo_call():
        return dist.all_to_all_single(halo_recv, halo_send, halo_splits, halo_splits, group=pg)

    def split_call():  # split's forward is local
        return rs_in.narrow(0, 0, 16).clone()

    static: dict[str, Any] = dict(shape=(16, 64), dtype=torch.float32)
    return {
        "all_reduce_forward": Op("g: all_reduce_forward 4 KiB", lambda x: all_reduce_forward(x, pg), ar, ar_call, None),
        "all_reduce_backward": Op(
            "f: all_reduce_backward 4 KiB", lambda x: all_reduce_backward(x, pg), ar, None, ar_call
        ),
        "all_gather": Op(
            "all_gather sizes given 4 KiB", lambda x: all_gather(x, pg, 0, [16] * r), ag, ag_call, rs_call
        ),
        "reduce_scatter": Op("reduce_scatter 4 KiB out", lambda x: reduce_scatter(x, pg, 0), rs_in, rs_call, ag_call),
        "split_gather": Op(
            "split_forward_gather_backward 4 KiB out",
            lambda x: split_forward_gather_backward(x, pg, 0),
            rs_in,
            split_call,
            ag_call,
        ),
        "gather_split": Op(
            "gather_forward_split_backward 4 KiB",
            lambda x: gather_forward_split_backward(x, pg, 0, [16] * r),
            ag,
            ag_call,
            None,
        ),
        "all_to_all": Op(
            "all_to_all heads->seq [1, 64, 16, 8]", lambda x: all_to_all(x, pg, 2, 1, 64 * r), a2a, a2a_call, a2a_call
        ),
        "halo_exchange": Op(
            "halo_exchange [1, 8, 32] widths 1, sizes given",
            lambda x: halo_exchange(x, pg, 2, 1, 1, sizes=[32] * r),
            halo,
            halo_call,
            halo_call,
        ),
        "send_forward": Op(
            "send_forward static 4 KiB",
            lambda x: send_forward(x, pg, **static),
            ag,
            lambda: _compat.isend(ag, pg, 1).wait(),
            None,
            grad=False,
            checks=False,
        ),
        "recv_backward": Op(
            "recv_backward static 4 KiB",
            lambda x: recv_backward(pg, **static),
            ag,
            lambda: _compat.irecv(p2p_buf, pg, 1).wait(),
            None,
            grad=False,
            checks=False,
        ),
    }


class _Floor(torch.autograd.Function):
    """The bare forward call in forward and the bare backward call in backward, nothing else."""

    @staticmethod
    def forward(ctx, x, bare_fwd, bare_bwd, out_shape):
        ctx.bare_bwd, ctx.in_shape = bare_bwd, x.shape
        if bare_fwd is not None:
            bare_fwd()
        return x.new_empty(out_shape)

    @staticmethod
    def backward(ctx, grad):
        if ctx.bare_bwd is not None:
            ctx.bare_bwd()
        return grad.new_empty(ctx.in_shape), None, None, None


def _repeat(fn, n: int, setup=contextlib.nullcontext):
    def run():
        with setup():
            for _ in range(n):
                fn()

    return run


def _variants(op: Op, n: int) -> dict:
    fn, x, bare_fwd, bare_bwd = op.fn, op.x, op.bare_fwd, op.bare_bwd
    xg = x.clone().requires_grad_(True)
    out_shape = fn(x).shape if op.grad else None

    def fwd_bwd():
        y = fn(xg)
        torch.autograd.backward(y, torch.ones_like(y))

    def floor():
        y = _Floor.apply(xg, bare_fwd, bare_bwd, out_shape)
        torch.autograd.backward(y, torch.ones_like(y))

    def bare_both():
        if bare_fwd is not None:
            bare_fwd()
        if bare_bwd is not None:
            bare_bwd()

    recorder = FlightRecorder()

    @contextlib.contextmanager
    def recording():
        previous = set_flight_recorder(recorder)
        try:
            yield
        finally:
            set_flight_recorder(previous)
            recorder.clear()

    @contextlib.contextmanager
    def ledger():
        with CommLedger():
            yield

    variants = {
        "bare": _repeat(bare_fwd or (lambda: x), n),
        "shardkit": _repeat(lambda: fn(x), n),
        "recorder": _repeat(lambda: fn(x), n, recording),
        "ledger": _repeat(lambda: fn(x), n, ledger),
    }
    if op.checks:
        variants["checks"] = _repeat(lambda: fn(x), n, _agreeing)
    if op.grad:
        variants.update(
            {"bare fwd+bwd": _repeat(bare_both, n), "floor fwd+bwd": _repeat(floor, n), "fwd+bwd": _repeat(fwd_bwd, n)}
        )
    return variants


def _check(name, fn, x, bare_fwd) -> list[str]:
    """The op's c10d calls (primitive, buffer sizes, splits) equal the bare forward's."""
    got: list = []
    want: list = []
    with _spy(got):
        fn(x)
    with _spy(want):
        if bare_fwd is not None:
            bare_fwd()
    return [] if got == want else [f"{name}: issued {got}, the bare variant times {want}"]


def host_overhead(pg, settings: Settings) -> list[Record]:
    """Microseconds per call of every op in :func:`_ops` above its bare c10d call, on ``pg`` (a
    fake process group of ``R`` ranks in this one process); see the module docstring."""
    world = pg.size()
    calls = 20 if settings.quick else 100
    previous = set_flight_recorder(None)  # the base variants run with the recorder off
    records = []
    try:
        with checks(False):
            for name, op in _ops(pg, settings.torch_device).items():
                agree(_check(name, op.fn, op.x, op.bare_fwd), pg, f"host_overhead {name}")
                times = time_interleaved(_variants(op, calls), pg, settings)
                times = {k: [t / calls for t in v] for k, v in times.items()}
                rec = Record(
                    "host_overhead",
                    dict(op=name, label=f"{op.label} R={world}", calls=calls),
                    world,
                    times,
                    checked="issues exactly the bare variant's c10d calls (spy); fake backend: no data",
                )
                _above(rec, "shardkit-bare us", "shardkit", "bare", GOALS.get(name))
                _above(rec, "default-bare us", "recorder", "bare", GOALS.get(name))  # a process's default
                if op.grad:
                    _above(rec, "fwd+bwd-bare us", "fwd+bwd", "bare fwd+bwd")
                    _above(rec, "fwd+bwd-floor us", "fwd+bwd", "floor fwd+bwd")
                for feature in ("recorder", "ledger", "checks"):
                    if feature in times:
                        _above(rec, f"{feature} cost us", feature, "shardkit")
                rec.ratio("shardkit/bare", "shardkit", "bare")
                records.append(rec)
    finally:
        set_flight_recorder(previous)
    return records


def _above(rec: Record, name: str, num: str, den: str, goal: float | None = None) -> None:
    """Per-round difference ``times[num] - times[den]`` in microseconds."""
    rec.ratios[name] = ([1e6 * (a - b) for a, b in zip(rec.times_s[num], rec.times_s[den])], goal)


OPS = (
    "all_reduce_forward",
    "all_reduce_backward",
    "all_gather",
    "reduce_scatter",
    "split_gather",
    "gather_split",
    "all_to_all",
    "halo_exchange",
    "send_forward",
    "recv_backward",
)
