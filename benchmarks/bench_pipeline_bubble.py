"""Measured 1F1B pipeline bubble against the theory ``(p - 1) / (m + p - 1)`` (docs/design.md, Benchmarks).

``python benchmarks/bench_pipeline_bubble.py [--rounds 40] [--warmup 5] [--f-ms 10] [--b-ms 20] [--quick]``

Spawns 4 local gloo ranks. For p in {2, 4} stages (ranks 0..p-1 of a pipeline group; the others
wait) and m in {1, 4, 8} microbatches, each round runs one 1F1B step
(:func:`shardkit.pipeline_parallel.run_schedule`) on a tiny ``[1, 8]`` activation whose stage
module sleeps ``--f-ms`` in forward and ``--b-ms`` in backward (a sleep, not a matmul, so the
2 shared cores do not distort the compute time). Per round: busy time of every stage (the
sleeps, measured), makespan (the slowest stage's wall time after a barrier); bubble =
``1 - sum(busy) / (p * makespan)`` (idle over total, all stages). Reported: median [q1, q3] of
the per-round bubble and of its ratio to the theory (the ratio also holds for F != B when
every stage has the same times). The losses are checked against the expected value each round.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from _paired import add_timing_args, cell, check_rounds, print_row, quantiles, run_and_report

CASES = ((2, 1), (2, 4), (2, 8), (4, 1), (4, 4), (4, 8))


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


def _run_case(P: int, M: int, args, groups) -> list[dict]:
    from shardkit.pipeline_parallel import PipelineStage, one_f_one_b_schedule, run_schedule

    rank = dist.get_rank()
    out = []
    if rank < P:
        pg = groups[P]
        busy = [0.0]
        module = _Stage(args.f_ms / 1e3, args.b_ms / 1e3, busy)
        loss = lambda y, t: (y * t).sum()  # noqa: E731
        stage = PipelineStage(module, pg, rank, P, loss_fn=loss)
        table = one_f_one_b_schedule(P, M)
        xs = [torch.ones(1, 8) for _ in range(M)]
        for i in range(args.warmup + args.rounds):
            busy[0] = 0.0
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            losses = run_schedule(stage, table, xs, xs)
            wall = time.perf_counter() - t0
            if rank == P - 1 and any(float(v) != 8.0 for v in losses):
                raise AssertionError(f"p={P} m={M}: losses {losses}, expected 8.0 each")
            stats = torch.tensor([wall, busy[0]], dtype=torch.float64)
            gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(P)]
            dist.all_gather(gathered, stats, group=pg)
            if i >= args.warmup:
                makespan = max(float(s[0]) for s in gathered)
                out.append(dict(makespan=makespan, busy=[float(s[1]) for s in gathered]))
    dist.barrier()
    return out


def _body(rank: int, pg, args) -> list[dict]:
    groups = {2: dist.new_group([0, 1]), 4: pg}
    return [dict(p=P, m=M, rounds=_run_case(P, M, args, groups)) for P, M in CASES]


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        P, M = res["p"], res["m"]
        theory = (P - 1) / (M + P - 1)
        bubbles = [1 - sum(r["busy"]) / (P * r["makespan"]) for r in res["rounds"]]
        rows.append(dict(p=P, m=M, theory=theory, bubble=quantiles(bubbles),
                         ratio=quantiles([b / theory for b in bubbles]) if theory > 0 else None,
                         makespan_ms=quantiles([1e3 * r["makespan"] for r in res["rounds"]])["median"]))
    return rows


def render(rows: list[dict], args, elapsed: float) -> None:
    print(f"1F1B bubble, F = {args.f_ms} ms, B = {args.b_ms} ms (sleep), gloo, {args.rounds} rounds after "
          f"{args.warmup} warm-up, median [q1, q3] per round, {elapsed:.0f} s")
    print_row("p", "m", "makespan ms", "ideal ms", "theory (p-1)/(m+p-1)", "measured bubble", "measured/theory")
    for r in rows:
        ideal = (r["m"] + r["p"] - 1) * (args.f_ms + args.b_ms)
        print_row(str(r["p"]), str(r["m"]), f"{r['makespan_ms']:.1f}", f"{ideal:.1f}", f"{r['theory']:.3f}",
                  cell(r["bubble"]), cell(r["ratio"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p)
    p.add_argument("--f-ms", type=float, default=10.0)
    p.add_argument("--b-ms", type=float, default=20.0)
    p.add_argument("--quick", action="store_true", help="F = 4 ms, B = 8 ms")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.f_ms, args.b_ms = 4.0, 8.0
    check_rounds(p, args)
    return run_and_report(args, _body, 4, summarize, render, dict(args=vars(args)),
                          prefix="shardkit-bench-bubble-", timeout_s=600)


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
