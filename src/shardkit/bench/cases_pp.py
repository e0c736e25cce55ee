"""The pipeline case: the measured 1F1B bubble against the theory ``(p - 1) / (m + p - 1)``,
then one row per schedule (:mod:`.cases_pp_schedules`).

For p in {2, 4} stages (ranks 0..p-1 of a pipeline group; the others wait) and m microbatches,
each round runs ``one_f_one_b_schedule(p, m)`` on a tiny ``[1, 8]`` activation whose stage
module sleeps ``F`` in forward and ``B`` in backward (a sleep, not a matmul, so that the 2 shared
cores do not distort the compute time). Two variants, interleaved per round in alternating order
(docs/design.md, Benchmarks):

* ``shardkit``: :func:`~shardkit.pipeline_parallel.run_schedule` (negotiated shapes, the stage's
  ShapeCache kept between rounds, as in a training loop);
* ``bare``: the same table as Megatron-LM's plan of calls (:func:`_plan`: combined send/receive
  calls in the steady state), module,
  loss and autograd calls, driven by a dozen lines over bare ``isend``/``irecv`` with shapes
  known in advance: the floor of a Python 1F1B on this machine.

Per round: each stage's busy time and the makespan (the slowest stage's wall time after a
barrier); bubble = ``1 - sum(busy) / (p * makespan)``: the fraction of stage time spent outside
compute. Busy is the stage's compute as the theory counts it, ``F`` and ``B``: the module's whole
forward and backward (its one autograd Function: the product with the weight and the sleep) and
the loss. Earlier versions counted the sleeps alone, which also charged the module's own work
to the bubble; ``bubble(sleeps only)`` is still reported from the same rounds, without a goal
(1-3 % above). What remains between the actions (the module call, the autograd engine, the P2P
calls and the wake-ups after them: 0.3-0.45 ms an action on this loaded machine) is idle time
for the theory, and the ``bare`` variant shows how much of it a Python 1F1B pays without
shardkit (``bubble/bare bubble``). The losses of both variants are checked every round.
``--quick`` runs p = 4, m = 4 with F = 4 ms and B = 8 ms (the full run: all four, 10 and 20 ms).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..pipeline_parallel import Action, PipelineStage, one_f_one_b_schedule, run_schedule
from ..pipeline_parallel._transfer import order_key
from ._method import Record, Settings, agree
from ._timing import Timer
from .cases_pp_schedules import schedules

__all__ = ["bubble"]


class _Call(NamedTuple):
    """One step of the bare baseline's plan (the plan of the former one-chunk runner).

    ``api`` is ``"compute"`` (``action`` set, no messages) or the name of a
    :mod:`shardkit.pipeline_parallel.p2p` function; ``sends``/``recvs`` list
    ``(towards, direction, microbatch)`` with ``towards`` in ``{"next", "prev"}`` and
    ``direction`` in ``{"F", "B"}``.
    """

    api: str
    action: Action | None = None
    sends: tuple = ()
    recvs: tuple = ()


def _plan(actions, stage: int, num_stages: int) -> tuple[_Call, ...]:
    """The P2P calls and computes stage ``stage`` of the bare baseline makes to run ``actions``.

    Receives come right before the action that needs them unless an earlier combined call
    brought the tensor already. A send is combined with the next action's receive when they go
    to the same neighbour, as in Megatron-LM's 1F1B steady state: ``F`` followed by ``B``
    gives ``send_forward_recv_backward`` (output to ``s + 1``, gradient from ``s + 1``), ``B``
    followed by ``F`` gives ``send_backward_recv_forward`` (input gradient to ``s - 1``,
    activation from ``s - 1``).
    """
    first, last = stage == 0, stage == num_stages - 1
    acts = list(actions)
    plan, have = [], set()  # have: (direction, microbatch) already received
    for i, (kind, m) in enumerate(acts):
        nxt = acts[i + 1] if i + 1 < len(acts) else None
        if kind == "F":
            if not first and ("F", m) not in have:
                plan.append(_Call("recv_forward", recvs=(("prev", "F", m),)))
            plan.append(_Call("compute", Action("F", m)))
            if not last:
                if nxt is not None and nxt[0] == "B":
                    have.add(("B", nxt[1]))
                    plan.append(
                        _Call("send_forward_recv_backward", sends=(("next", "F", m),), recvs=(("next", "B", nxt[1]),))
                    )
                else:
                    plan.append(_Call("send_forward", sends=(("next", "F", m),)))
        else:
            if not last and ("B", m) not in have:
                plan.append(_Call("recv_backward", recvs=(("next", "B", m),)))
            plan.append(_Call("compute", Action("B", m)))
            if not first:
                if nxt is not None and nxt[0] == "F":
                    have.add(("F", nxt[1]))
                    plan.append(
                        _Call("send_backward_recv_forward", sends=(("prev", "B", m),), recvs=(("prev", "F", nxt[1]),))
                    )
                else:
                    plan.append(_Call("send_backward", sends=(("prev", "B", m),)))
    return tuple(plan)


class _Sleep(torch.autograd.Function):
    """``x * w`` that takes ``f`` seconds forward and ``b`` backward; ``busy = [compute, sleeps]``."""

    @staticmethod
    def forward(ctx, x, w, f, b, busy):
        t0 = time.perf_counter()
        ctx.save_for_backward(x, w)
        ctx.b, ctx.busy = b, busy
        y = x * w
        t1 = time.perf_counter()
        time.sleep(f)
        t2 = time.perf_counter()
        busy[0] += t2 - t0
        busy[1] += t2 - t1
        return y

    @staticmethod
    def backward(ctx, g):
        t0 = time.perf_counter()
        x, w = ctx.saved_tensors
        gx, gw = g * w, (g * x).sum(0)
        t1 = time.perf_counter()
        time.sleep(ctx.b)
        t2 = time.perf_counter()
        ctx.busy[0] += t2 - t0
        ctx.busy[1] += t2 - t1
        return gx, gw, None, None, None


class _Stage(torch.nn.Module):
    def __init__(self, f, b, busy, dev):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8, device=dev))
        self.f, self.b, self.busy = f, b, busy

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.f, self.b, self.busy)


def _bare_1f1b(stage, plan, xs, rank: int, P: int, M: int, pg) -> list:
    """The runner's plan over bare c10d P2P (static ``[1, 8]`` shapes, slot order, sends waited
    at the end); returns the last stage's losses."""

    got: dict[tuple, torch.Tensor] = {}
    stash: dict[int, tuple] = {}
    out: dict[tuple, torch.Tensor] = {}
    losses: list[torch.Tensor] = []
    pending: list = []  # c10d works (typed Work | None by torch)
    for call in plan:
        if call.api == "compute":
            kind, m = call.action
            if kind == "F":
                x = xs[m] if rank == 0 else got.pop(("F", m)).requires_grad_(True)
                y = stage.forward(x)
                if rank == P - 1:
                    loss = stage.loss(y, xs[m])
                    losses.append(loss.detach())
                    y = loss / M
                stash[m] = (x, y)
                out[("F", m)] = y.detach()
            else:
                x, y = stash.pop(m)
                torch.autograd.backward(y, None if rank == P - 1 else got.pop(("B", m)))
                out[("B", m)] = x.grad
            continue
        msgs = [(True, t, d, m) for t, d, m in call.sends] + [(False, t, d, m) for t, d, m in call.recvs]
        waits: list = []
        for is_send, towards, d, m in sorted(msgs, key=lambda x: order_key(rank, x[0], x[1])):
            peer = rank + (1 if towards == "next" else -1)
            if is_send:
                pending.append(dist.isend(out.pop((d, m)).contiguous(), peer, group=pg))
            else:
                got[(d, m)] = torch.empty(1, 8, device=xs[0].device)
                waits.append(dist.irecv(got[(d, m)], peer, group=pg))
        for w in waits:
            w.wait()
    for w in pending:
        w.wait()
    return losses


def _case(P: int, M: int, f_ms: float, b_ms: float, pg, settings: Settings) -> Record | None:

    rank, dev = dist.get_rank(), settings.torch_device
    timer = Timer(dev, events=False)  # the wall includes host sleeps: synchronize, read the host clock
    names = ("shardkit", "bare")
    rounds: dict[str, list] = {k: [] for k in names}
    failures = []
    if rank < P:
        busy = [0.0, 0.0]

        def loss_fn(y, t):
            t0 = time.perf_counter()
            out = (y * t).sum()
            busy[0] += time.perf_counter() - t0
            return out

        stage = PipelineStage(_Stage(f_ms / 1e3, b_ms / 1e3, busy, dev), pg, rank, P, loss_fn=loss_fn)
        table = one_f_one_b_schedule(P, M)
        plan = _plan(table[rank], rank, P)
        xs = [torch.ones(1, 8, device=dev) for _ in range(M)]
        fns = {
            "shardkit": lambda: run_schedule(stage, table, xs, xs),
            "bare": lambda: _bare_1f1b(stage, plan, xs, rank, P, M, pg),
        }
        for i in range(settings.warmup + settings.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                busy[0] = busy[1] = 0.0
                stage.module.zero_grad()
                dist.barrier(group=pg)
                timer.start()
                losses = fns[name]()
                wall = timer.stop()
                if rank == P - 1 and (losses is None or len(losses) != M or any(float(v) != 8.0 for v in losses)):
                    failures.append(f"{name} p={P} m={M}: losses {losses}, expected {M} x 8.0")
                stats = torch.tensor([wall, busy[0], busy[1]], dtype=torch.float64, device=dev)
                gathered = [torch.zeros(3, dtype=torch.float64, device=dev) for _ in range(P)]
                dist.all_gather(gathered, stats, group=pg)
                if i >= settings.warmup:
                    rounds[name].append(
                        (max(float(s[0]) for s in gathered), [(float(s[1]), float(s[2])) for s in gathered])
                    )
        agree(failures, pg, f"pipeline bubble p={P} m={M}")
    dist.barrier()
    if rank >= P:
        return None
    theory = (P - 1) / (M + P - 1)

    def bubbles(name: str, which: int) -> list[float]:
        return [1 - sum(b[which] for b in busy_) / (P * mk) for mk, busy_ in rounds[name]]

    rec = Record(
        "pipeline_bubble",
        dict(p=P, m=M, f_ms=f_ms, b_ms=b_ms, theory=theory, label=f"p={P} m={M}"),
        P,
        {
            "makespan": [mk for mk, _ in rounds["shardkit"]],
            "bare makespan": [mk for mk, _ in rounds["bare"]],
            "ideal": [(M + P - 1) * (f_ms + b_ms) / 1e3] * len(rounds["shardkit"]),
        },
        checked="every round's microbatch losses (both variants) equal the expected 8.0",
    )
    mine, bare = bubbles("shardkit", 0), bubbles("bare", 0)
    rec.ratios["bubble"] = (mine, None)
    rec.ratios["bubble/theory"] = ([b / theory for b in mine], 1.2)
    rec.ratios["bare bubble/theory"] = ([b / theory for b in bare], None)
    rec.ratios["bubble/bare bubble"] = ([a / b for a, b in zip(mine, bare)], None)
    rec.ratios["bubble(sleeps only)/theory"] = ([b / theory for b in bubbles("shardkit", 1)], None)
    return rec


def bubble(pg, settings: Settings) -> list[Record]:
    f_ms, b_ms = (4.0, 8.0) if settings.quick else (10.0, 20.0)
    groups = {2: dist.new_group([0, 1]), 4: pg}
    # --quick: one 1F1B pipeline (the schedules' rows run 1F1B at p = 4, m = 8 as their base)
    sizes = ((4, 4),) if settings.quick else ((2, 4), (2, 8), (4, 4), (4, 8))
    out = [_case(P, M, f_ms, b_ms, groups[P], settings) for P, M in sizes]
    return [r for r in out if r is not None] + schedules(pg, settings)
