"""Paired, interleaved benchmark of pipeline P2P: shardkit ``send_forward``/``recv_forward`` vs
bare ``dist.isend``/``dist.irecv`` (DESIGN.md section 5).

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
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

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


def _time(fns, pg, warmup: int, rounds: int, reps: int) -> dict[str, list[float]]:
    """Seconds per transfer and round, max over ranks; variants interleaved, order alternating."""
    names = list(fns)
    times = torch.zeros(rounds, len(names), dtype=torch.float64)
    for i in range(warmup + rounds):
        for j in (range(len(names)) if i % 2 == 0 else reversed(range(len(names)))):
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            for _ in range(reps):
                fns[names[j]]()
            if i >= warmup:
                times[i - warmup, j] = (time.perf_counter() - t0) / reps
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=pg)
    return {name: times[:, j].tolist() for j, name in enumerate(names)}


def _rank_main(rank: int, args, store_path: str, result_path: str) -> None:
    from shardkit.comm import checks

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    try:
        checks(False)
        pg, results = dist.group.WORLD, []
        for nbytes in args.sizes:
            fns, x = _prepare(nbytes, pg)
            for name, fn in fns.items():  # correctness of every benchmarked case
                got = fn()
                if rank == 1 and not torch.equal(got, x):
                    raise AssertionError(f"{name} at {nbytes} B: received tensor differs")
            reps = max(1, min(args.reps, (64 * 1024 * 1024) // (nbytes * 8)))
            results.append(dict(bytes=nbytes, reps=reps, times_s=_time(fns, pg, args.warmup, args.rounds, reps)))
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _q(values) -> dict[str, float]:
    q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return dict(zip(("q1", "median", "q3"), q.tolist()))


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        t, n = res["times_s"], res["bytes"]
        rows.append(dict(
            bytes=n, reps=res["reps"],
            us={k: 1e6 * _q(t[k])["median"] for k in VARIANTS},
            static_over_bare=_q([s / b for s, b in zip(t["static"], t["bare"])]),
            dynamic_over_bare=_q([d / b for d, b in zip(t["dynamic"], t["bare"])]),
            busbw_GBps={k: n / _q(t[k])["median"] / 1e9 for k in VARIANTS},
        ))
    return rows


def _cell(q: dict) -> str:
    return f"{q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}]"


def render(rows: list[dict], args, elapsed: float) -> None:
    print(f"pipeline P2P stage 0 -> 1, float32, gloo, 2 ranks, {args.rounds} rounds after {args.warmup} warm-up, "
          f"median [q1, q3] of per-round ratios, {elapsed:.0f} s")
    print(" | ".join(("size", "reps/op", "bare us", "static us", "dynamic us", "static/bare", "dynamic/bare",
                      "busbw bare/static/dynamic GB/s")))
    for r in rows:
        size = f"{r['bytes'] // 1024} KiB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MiB"
        bw = "/".join(f"{r['busbw_GBps'][k]:.2f}" for k in VARIANTS)
        print(" | ".join((size, str(r["reps"]), *(f"{r['us'][k]:.1f}" for k in VARIANTS),
                          _cell(r["static_over_bare"]), _cell(r["dynamic_over_bare"]), bw)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="transfers per timed op (fewer for large sizes)")
    p.add_argument("--sizes", type=lambda s: tuple(int(v) for v in s.split(",")), default=SIZES,
                   help="comma-separated byte counts (multiples of 256)")
    p.add_argument("--quick", action="store_true", help="40 rounds, 5 reps")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.reps = 40, 5
    if args.rounds < 40 or args.warmup < 5:
        p.error("DESIGN.md section 5: at least 40 rounds after at least 5 warm-up rounds")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-p2p-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        torch.multiprocessing.start_processes(_rank_main, args=(args, os.path.join(tmp, "store"), result_path),
                                              nprocs=2, start_method="spawn")
        with open(result_path) as f:
            results = json.load(f)
    rows = summarize(results)
    render(rows, args, time.perf_counter() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rounds=args.rounds, warmup=args.warmup, summary=rows, raw=results), f, indent=1)
    return 0


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
