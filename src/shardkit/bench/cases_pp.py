"""The pipeline case: the measured 1F1B bubble against the theory ``(p - 1) / (m + p - 1)``.

For p in {2, 4} stages (ranks 0..p-1 of a pipeline group; the others wait) and m microbatches,
each round runs one :func:`~shardkit.pipeline_parallel.run_schedule` of
``one_f_one_b_schedule(p, m)`` on a tiny ``[1, 8]`` activation whose stage module sleeps ``F`` in
forward and ``B`` in backward (a sleep, not a matmul, so that the 2 shared cores do not distort
the compute time). Per round: busy time of every stage (the sleeps, measured) and the makespan
(the slowest stage's wall time after a barrier); bubble = ``1 - sum(busy) / (p * makespan)``.
The losses are checked against the expected value every round.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ._method import Record, Settings, agree

__all__ = ["bubble"]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f, b, busy):
        ctx.b, ctx.busy = b, busy
        t0 = time.perf_counter()
        time.sleep(f)
        busy[0] += time.perf_counter() - t0
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        t0 = time.perf_counter()
        time.sleep(ctx.b)
        ctx.busy[0] += time.perf_counter() - t0
        return g, None, None, None


class _Stage(torch.nn.Module):
    def __init__(self, f, b, busy):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))
        self.f, self.b, self.busy = f, b, busy

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.f, self.b, self.busy)


def _case(P: int, M: int, f_ms: float, b_ms: float, pg, settings: Settings) -> Record | None:
    from ..pipeline_parallel import PipelineStage, one_f_one_b_schedule, run_schedule

    rank = dist.get_rank()
    rounds = []
    failures = []
    if rank < P:
        busy = [0.0]
        stage = PipelineStage(_Stage(f_ms / 1e3, b_ms / 1e3, busy), pg, rank, P, loss_fn=lambda y, t: (y * t).sum())
        table = one_f_one_b_schedule(P, M)
        xs = [torch.ones(1, 8) for _ in range(M)]
        for i in range(settings.warmup + settings.rounds):
            busy[0] = 0.0
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            losses = run_schedule(stage, table, xs, xs)
            wall = time.perf_counter() - t0
            if rank == P - 1 and losses is not None and any(float(v) != 8.0 for v in losses):
                failures.append(f"p={P} m={M}: losses {[float(v) for v in losses]}, expected 8.0 each")
            stats = torch.tensor([wall, busy[0]], dtype=torch.float64)
            gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(P)]
            dist.all_gather(gathered, stats, group=pg)
            if i >= settings.warmup:
                rounds.append((max(float(s[0]) for s in gathered), [float(s[1]) for s in gathered]))
        agree(failures, pg, f"pipeline bubble p={P} m={M}")
    dist.barrier()
    if rank >= P:
        return None
    theory = (P - 1) / (M + P - 1)
    bubbles = [1 - sum(b) / (P * mk) for mk, b in rounds]
    rec = Record("pipeline_bubble", dict(p=P, m=M, f_ms=f_ms, b_ms=b_ms, theory=theory, label=f"p={P} m={M}"), P,
                 {"makespan": [mk for mk, _ in rounds],
                  "ideal": [(M + P - 1) * (f_ms + b_ms) / 1e3] * len(rounds)},
                 checked="every round's microbatch losses equal the expected 8.0")
    rec.ratios["bubble"] = (bubbles, None)
    rec.ratios["bubble/theory"] = ([b / theory for b in bubbles], 1.2)
    return rec


def bubble(pg, settings: Settings) -> list[Record]:
    f_ms, b_ms = (4.0, 8.0) if settings.quick else (10.0, 20.0)
    groups = {2: dist.new_group([0, 1]), 4: pg}
    out = [_case(P, M, f_ms, b_ms, groups[P], settings) for P, M in ((2, 4), (2, 8), (4, 4), (4, 8))]
    return [r for r in out if r is not None]
