"""The pipeline schedules case: every schedule of :data:`~shardkit.pipeline_parallel.tables.SCHEDULES`
run by :func:`~shardkit.pipeline_parallel.run_schedule`, its measured bubble against its own
theory and against 1F1B's measured bubble in the same rounds.

Each of the ``p`` ranks holds ``v`` chunks (a :class:`~shardkit.pipeline_parallel.PipelineStage` of ``v`` chunks);
a chunk is ``x -> h * s(w)`` on a ``[1, 8]`` activation where ``h = _Forward(x)`` sleeps
``F / v`` in forward and ``I / v`` in backward (the input gradient) and ``s(w)`` is an identity
on the chunk's weight that sleeps ``W / v`` in backward (the weight gradient). So a rank's work
is the same ``F``, ``I + W = B`` per microbatch under every ``v``, and the zero-bubble schedules'
split finds ``W`` where it is: autograd's ``mul`` computes only the gradient asked for, so ``I``
(:func:`~shardkit.pipeline_parallel.split_backward.input_grad`) never runs the weight's sleep
and ``W`` never the input's. Sleeps, not matmuls, keep the 2 shared cores from distorting the
compute time (as the 1F1B case, :mod:`.cases_pp`).

Two step costs (``F = I = W``): 10 ms, the issue's rows, where the runner's fixed cost per step
(the Python of a step and a P2P hand-over on the critical path, a few tenths of a millisecond on
2 shared cores) is a visible part of the makespan; and 40 ms (labels end ``(40 ms steps)``),
where it is small against the compute, as a GPU step's launch cost is against its kernels: the
schedule's structure then decides the bubble. ``--quick`` runs 4 ms only, and only the schedules
with a goal and 1F1B (:data:`QUICK`).

Per round, every schedule runs once, in a rotating order; busy time is what the chunks' sleeps
and products took, the makespan the slowest rank's wall time after a barrier, and
``bubble = 1 - sum(busy) / (p * makespan)``. Ratios: ``bubble/theory`` against the dataflow
simulation of the same table with the same costs
(:func:`~shardkit.pipeline_parallel.simulate.simulate_steps`: sends are free there, so the
P2P and Python time between steps shows up as the excess) and ``bubble/1f1b`` against 1F1B's
bubble of the same round. Goals at p = 4, m = 8 (the issue's): interleaved 1F1B (v = 2) <=
0.75 of 1F1B (theory 0.58), ZB-H1 <= 0.5, ZBV and DualPipeV <= 0.35. Every round's losses are
checked on the rank holding the last chunk.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..pipeline_parallel import PipelineStage, run_schedule
from ..pipeline_parallel.simulate import simulate_steps
from ..pipeline_parallel.tables import SCHEDULES, schedule_table
from ._method import Record, Settings, agree
from ._timing import Timer

__all__ = ["schedules"]

# schedule -> chunks per rank in this case
CHUNKS = {"1f1b": 1, "gpipe": 1, "interleaved-1f1b": 2, "looped-bfs": 2, "zb-h1": 1, "zbv": 2, "dualpipev": 2}
GOALS = {"interleaved-1f1b": 0.75, "zb-h1": 0.5, "zbv": 0.35, "dualpipev": 0.35}  # bubble / 1F1B's
# --quick: the schedules with a goal and 1F1B, their base (GPipe and looped BFS add 40 % of the
# case's sleeps and no goal).
QUICK = ("1f1b", *GOALS)


def _names(settings: Settings) -> list[str]:
    return [name for name in CHUNKS if not settings.quick or name in QUICK]


class _Forward(torch.autograd.Function):
    """Identity on the activation: ``f`` seconds forward, ``i`` backward (the input gradient)."""

    @staticmethod
    def forward(ctx, x, f, i, busy):
        t0 = time.perf_counter()
        time.sleep(f)
        ctx.i, ctx.busy = i, busy
        busy[0] += time.perf_counter() - t0
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        t0 = time.perf_counter()
        time.sleep(ctx.i)
        ctx.busy[0] += time.perf_counter() - t0
        return g, None, None, None


class _WeightGrad(torch.autograd.Function):
    """Identity on the weight: ``w`` seconds in backward (the weight gradient)."""

    @staticmethod
    def forward(ctx, weight, w, busy):
        ctx.w, ctx.busy = w, busy
        return weight.clone()

    @staticmethod
    def backward(ctx, g):
        t0 = time.perf_counter()
        time.sleep(ctx.w)
        ctx.busy[0] += time.perf_counter() - t0
        return g, None, None


class _Chunk(torch.nn.Module):
    def __init__(self, f: float, i: float, w: float, busy: list, dev: torch.device | str = "cpu") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8, device=dev))
        self.f, self.i, self.w, self.busy = f, i, w, busy

    def forward(self, x):
        h = _Forward.apply(x, self.f, self.i, self.busy)  # counts its own time
        t0 = time.perf_counter()
        y = h * _WeightGrad.apply(self.weight, self.w, self.busy)
        self.busy[0] += time.perf_counter() - t0
        return y


def _stage(name: str, P: int, costs_s: dict, busy: list, pg, dev: torch.device) -> PipelineStage:
    spec, v = SCHEDULES[name], CHUNKS[name]
    modules = [_Chunk(costs_s["F"] / v, costs_s["I"] / v, costs_s["W"] / v, busy, dev) for _ in range(v)]

    def loss_fn(y, t):
        t0 = time.perf_counter()
        out = (y * t).sum()
        busy[0] += time.perf_counter() - t0
        return out

    return PipelineStage(modules, pg, loss_fn=loss_fn, placement=spec.placement)


def _theory(name: str, P: int, M: int, costs_s: dict) -> float:
    spec, v = SCHEDULES[name], CHUNKS[name]
    costs = {k: c / v for k, c in costs_s.items()}
    costs["B"] = costs["I"] + costs["W"]
    table = schedule_table(name, P, v, M)
    return simulate_steps(table, placement=spec.placement, v=v, num_microbatches=M, costs=costs).bubble


def _rounds(P: int, M: int, costs_s: dict, pg, settings: Settings) -> dict[str, list[tuple[float, float]]]:
    """``(makespan, busy summed over ranks)`` per round and schedule."""
    rank, dev = dist.get_rank(pg), settings.torch_device
    timer = Timer(dev, events=False)  # the wall includes host sleeps: synchronize, read the host clock
    busy = [0.0]
    names = _names(settings)
    stages = {name: _stage(name, P, costs_s, busy, pg, dev) for name in names}
    # The inputs need a gradient, as a real first chunk's input does (the embedding's output): else
    # autograd skips chunk 0's input-gradient sleep, its rank idles for I and every bubble reads high.
    xs = [torch.ones(1, 8, device=dev, requires_grad=True) for _ in range(M)]
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    failures: list[str] = []
    for i in range(settings.warmup + settings.rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            stage = stages[name]
            busy[0] = 0.0
            for module in stage.modules:
                module.zero_grad()
            dist.barrier(group=pg)
            timer.start()
            losses = run_schedule(stage, name, xs, xs, num_microbatches=M)
            wall = timer.stop()
            if stage.is_last and (losses is None or len(losses) != M or any(float(v) != 8.0 for v in losses)):
                failures.append(f"{name} p={P} m={M}: losses {losses}, expected {M} x 8.0")
            stats = torch.tensor([wall, busy[0]], dtype=torch.float64, device=dev)
            gathered = [torch.zeros(2, dtype=torch.float64, device=dev) for _ in range(P)]
            dist.all_gather(gathered, stats, group=pg)
            if i >= settings.warmup:
                out[name].append((max(float(s[0]) for s in gathered), sum(float(s[1]) for s in gathered)))
    agree(failures, pg, f"pipeline schedules p={P} m={M} (rank {rank})")
    return out


def schedules(pg, settings: Settings) -> list[Record]:
    """One record per schedule at p = 4, m = 8 and step cost (see the module docstring): 4 ms
    (``--quick``), else 10 ms and 40 ms."""
    records = []
    for step_ms in (4.0,) if settings.quick else (10.0, 40.0):
        records += _records(pg, settings, step_ms)
    return records


def _records(pg, settings: Settings, step_ms: float) -> list[Record]:
    """One record per schedule with ``F = I = W = step_ms``; the label names the cost when it is
    not the 10 ms of the issue's rows."""
    P, M = dist.get_world_size(pg), 8
    f_ms = i_ms = w_ms = step_ms
    costs_s = {"F": f_ms / 1e3, "I": i_ms / 1e3, "W": w_ms / 1e3}
    rounds = _rounds(P, M, costs_s, pg, settings)
    suffix = "" if step_ms == 10.0 else f" ({step_ms:g} ms steps)"

    def bubbles(name: str) -> list[float]:
        return [1 - busy / (P * makespan) for makespan, busy in rounds[name]]

    base = bubbles("1f1b")
    records = []
    for name in _names(settings):
        v, theory = CHUNKS[name], _theory(name, P, M, costs_s)
        mine = bubbles(name)
        rec = Record(
            "pipeline_bubble",
            dict(
                schedule=name,
                p=P,
                v=v,
                m=M,
                f_ms=f_ms,
                i_ms=i_ms,
                w_ms=w_ms,
                theory=theory,
                label=f"{name} p={P} v={v} m={M}{suffix}",
            ),
            P,
            {"makespan": [mk for mk, _ in rounds[name]]},
            checked="every round's microbatch losses equal the expected 8.0",
        )
        rec.ratios["bubble"] = (mine, None)
        rec.ratios["bubble/theory"] = ([b / theory for b in mine] if theory > 0 else mine, None)
        rec.ratios["bubble/1f1b"] = ([a / b for a, b in zip(mine, base)], GOALS.get(name))
        records.append(rec)
    return records
