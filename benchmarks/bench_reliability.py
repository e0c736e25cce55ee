"""Paired, interleaved benchmark of the reliability features per op: the flight recorder, the
check mode, and learning the sizes (no ``sizes=``) against the plain op (docs/design.md (Benchmarks)).

``python benchmarks/bench_reliability.py [--rounds 40] [--warmup 5] [--reps 10] [--json PATH]``

Spawns 2 local gloo ranks. For each op and size, every round times these variants interleaved
(alternating order, a barrier before each op, per-op time = max over ranks, ``--reps`` calls in
a row reported per call):

- ``plain``: sizes given, flight recorder off, check mode off (the baseline);
- ``recorder``: as plain with the flight recorder on (the default);
- ``checks``: as plain with the check mode on (recorder off);
- ``learned``: no sizes given (one metadata all-gather), recorder and checks off.

Ops: ``all_gather`` (dim 0, sizes given), ``all_to_all`` (``[S/R, N, D]`` -> ``[S, N/R, D]``,
``gather_size`` given), ``ulysses_attention`` (``seq_len`` given). Sizes 16 KiB and 1 MiB per
rank (both sides of gloo's ~256 KiB crossover). Reported: median [q1, q3] of the per-round
ratios variant / plain, and the extra microseconds per call (median difference). Every
variant's result is checked bitwise against plain's before timing. Also prints the cost of one
``FlightRecorder.record`` call measured alone (single process, 200k calls).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _paired import add_timing_args, cell, check_rounds, print_row, quantiles, ratio_q, run_and_report, time_interleaved

SIZES = (16 * 1024, 1024 * 1024)  # bytes per rank
VARIANTS = ("plain", "recorder", "checks", "learned")


def _ops(nbytes: int, pg):
    from shardkit import all_gather, all_to_all
    from shardkit.context_parallel import ulysses_attention

    R, n = pg.size(), nbytes // 4
    d = 64
    x = torch.randn(n // d, d)  # all_gather: [n / 64, 64] float32 per rank
    seq = n // (8 * d)  # all_to_all / ulysses: [S_r, 8, 64]
    a = torch.randn(seq, 8, d)
    q = torch.randn(1, max(1, seq // 8), 8, d)  # attention: a smaller S (compute grows as S^2)
    s_q = q.shape[1] * R
    return {
        "all_gather": (lambda sizes: all_gather(x, pg, 0, sizes=[x.shape[0]] * R if sizes else None)),
        "all_to_all": (lambda sizes: all_to_all(a, pg, 1, 0, gather_size=seq * R if sizes else None)),
        "ulysses_attention": (
            lambda sizes: ulysses_attention(q, q, q, pg, causal=True, seq_len=s_q if sizes else None)
        ),
    }


def _variants(op):
    from shardkit.comm import checks
    from shardkit.comm import flight_recorder as fr

    recorder = fr.FlightRecorder()

    def with_state(rec, check, sizes):
        def run():
            previous = fr.set_flight_recorder(rec)
            try:
                with checks(check):
                    return op(sizes)
            finally:
                fr.set_flight_recorder(previous)

        return run

    return {
        "plain": with_state(None, False, True),
        "recorder": with_state(recorder, False, True),
        "checks": with_state(None, True, True),
        "learned": with_state(None, False, False),
    }


def _record_cost_us(calls: int = 200_000) -> float:
    from shardkit.comm import flight_recorder as fr

    rec = fr.FlightRecorder()
    t0 = time.perf_counter()
    for _ in range(calls):
        rec.record("all_to_all_single", "ulysses_attention", "forward", 4, None, (1, 13, 6, 8), None, None)
    return (time.perf_counter() - t0) / calls * 1e6


def _body(rank: int, pg, args) -> dict:
    results = []
    for nbytes in args.sizes:
        for name, op in _ops(nbytes, pg).items():
            fns = _variants(op)
            want = fns["plain"]()
            for v, fn in fns.items():  # correctness of every benchmarked case
                if not torch.equal(fn(), want):
                    raise AssertionError(f"{name} {v} at {nbytes} B differs from plain")
            times = time_interleaved(fns, pg, args.warmup, args.rounds, args.reps)
            results.append(dict(op=name, bytes=nbytes, times_s=times))
    return dict(ops=results, record_us=_record_cost_us() if rank == 0 else None)


def summarize(result: dict) -> dict:
    rows = []
    for res in result["ops"]:
        t = res["times_s"]
        rows.append(
            dict(
                op=res["op"],
                bytes=res["bytes"],
                us={k: 1e6 * quantiles(t[k])["median"] for k in VARIANTS},
                ratio={k: ratio_q(t[k], t["plain"]) for k in VARIANTS[1:]},
                extra_us={
                    k: 1e6 * quantiles([a - b for a, b in zip(t[k], t["plain"])])["median"] for k in VARIANTS[1:]
                },
            )
        )
    return dict(rows=rows, record_us=result["record_us"])


def render(summary: dict, args, elapsed: float) -> None:
    print(
        f"reliability features per op, gloo, 2 ranks, {args.rounds} rounds after {args.warmup} warm-up, "
        f"{args.reps} calls per op, median [q1, q3] of per-round ratios to plain, {elapsed:.0f} s"
    )
    print_row("op", "size/rank", "plain us", *(f"{k}/plain (+us)" for k in VARIANTS[1:]))
    for r in summary["rows"]:
        size = f"{r['bytes'] // 1024} KiB"
        print_row(
            r["op"],
            size,
            f"{r['us']['plain']:.1f}",
            *(f"{cell(r['ratio'][k])} ({r['extra_us'][k]:+.1f})" for k in VARIANTS[1:]),
        )
    print(f"FlightRecorder.record alone: {summary['record_us']:.2f} us per call")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p)
    p.add_argument("--reps", type=int, default=10, help="calls per timed op")
    p.add_argument(
        "--sizes",
        type=lambda s: tuple(int(v) for v in s.split(",")),
        default=SIZES,
        help="comma-separated byte counts per rank (multiples of 16 KiB)",
    )
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    check_rounds(p, args)
    return run_and_report(
        args,
        _body,
        2,
        summarize,
        render,
        dict(rounds=args.rounds, warmup=args.warmup),
        prefix="shardkit-bench-reliability-",
    )


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
