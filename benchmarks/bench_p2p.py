"""Paired, interleaved benchmark of pipeline P2P: shardkit ``send_forward``/``recv_forward`` vs
bare ``dist.isend``/``dist.irecv`` (docs/design.md, Benchmarks).

``python benchmarks/bench_p2p.py [--rounds 40] [--warmup 5] [--quick] [--json PATH]``

Spawns 2 local gloo ranks (FileStore rendezvous, one intra-op thread each); stage 0 sends one
float32 tensor to stage 1. For every size each round times, interleaved with alternating order
and a barrier before each op (per-op time = max over ranks; an op is ``--reps`` transfers in a
row, reported per transfer):

- ``bare``: ``dist.isend(x).wait()`` / ``dist.irecv(torch.empty(...)).wait()``;
- ``static``: ``send_forward(x, g, shape=, dtype=)`` / ``recv_forward(g, shape=, dtype=)``
  (one message: the payload);
- ``dynamic``: ``send_forward(x, g)`` / ``recv_forward(g)`` (a 160-byte header first).

Reported: median [q1, q3] of per-round ratios static / bare and dynamic / bare, and the bus
bandwidth of each (send/recv factor 1). Goals: 8 MiB <= 1.05; 16 KiB static <= 1.25. Every
variant's received tensor is checked bitwise before timing. ``--quick``: 40 rounds, fewer reps.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from _paired import add_timing_args, cell, check_rounds, print_row, quantiles, ratio_q, run_and_report, time_interleaved

SIZES = (16 * 1024, 8 * 1024 * 1024)  # bytes: both sides of gloo's ~256 KiB crossover
VARIANTS = ("bare", "static", "dynamic")


def _prepare(nbytes: int, pg):
    from shardkit.pipeline_parallel import recv_forward, send_forward

    rank = dist.get_rank(pg)
    shape = (nbytes // 4 // 64, 64)
    x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)

    def bare():
        if rank == 0:
            dist.isend(x, 1, group=pg).wait()
            return None
        buf = torch.empty(shape, dtype=torch.float32)
        dist.irecv(buf, 0, group=pg).wait()
        return buf

    def static():
        if rank == 0:
            return send_forward(x, pg, shape=shape, dtype=torch.float32)
        return recv_forward(pg, shape=shape, dtype=torch.float32)

    def dynamic():
        return send_forward(x, pg) if rank == 0 else recv_forward(pg)

    return {"bare": bare, "static": static, "dynamic": dynamic}, x


def _body(rank: int, pg, args) -> list[dict]:
    results = []
    for nbytes in args.sizes:
        fns, x = _prepare(nbytes, pg)
        for name, fn in fns.items():  # correctness of every benchmarked case
            got = fn()
            if rank == 1 and not torch.equal(got, x):
                raise AssertionError(f"{name} at {nbytes} B: received tensor differs")
        reps = max(1, min(args.reps, (64 * 1024 * 1024) // (nbytes * 8)))
        results.append(dict(bytes=nbytes, reps=reps, times_s=time_interleaved(fns, pg, args.warmup, args.rounds, reps)))
    return results


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        t, n = res["times_s"], res["bytes"]
        rows.append(dict(
            bytes=n, reps=res["reps"],
            us={k: 1e6 * quantiles(t[k])["median"] for k in VARIANTS},
            static_over_bare=ratio_q(t["static"], t["bare"]),
            dynamic_over_bare=ratio_q(t["dynamic"], t["bare"]),
            busbw_GBps={k: n / quantiles(t[k])["median"] / 1e9 for k in VARIANTS},
        ))
    return rows


def render(rows: list[dict], args, elapsed: float) -> None:
    print(f"pipeline P2P stage 0 -> 1, float32, gloo, 2 ranks, {args.rounds} rounds after {args.warmup} warm-up, "
          f"median [q1, q3] of per-round ratios, {elapsed:.0f} s")
    print_row("size", "reps/op", "bare us", "static us", "dynamic us", "static/bare", "dynamic/bare",
              "busbw bare/static/dynamic GB/s")
    for r in rows:
        size = f"{r['bytes'] // 1024} KiB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MiB"
        bw = "/".join(f"{r['busbw_GBps'][k]:.2f}" for k in VARIANTS)
        print_row(size, str(r["reps"]), *(f"{r['us'][k]:.1f}" for k in VARIANTS), cell(r["static_over_bare"]),
                  cell(r["dynamic_over_bare"]), bw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p, rounds=60)
    p.add_argument("--reps", type=int, default=20, help="transfers per timed op (fewer for large sizes)")
    p.add_argument("--sizes", type=lambda s: tuple(int(v) for v in s.split(",")), default=SIZES,
                   help="comma-separated byte counts (multiples of 256)")
    p.add_argument("--quick", action="store_true", help="40 rounds, 5 reps")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.reps = 40, 5
    check_rounds(p, args)
    return run_and_report(args, _body, 2, summarize, render, dict(rounds=args.rounds, warmup=args.warmup),
                          prefix="shardkit-bench-p2p-")


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
