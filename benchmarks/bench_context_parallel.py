"""Paired, interleaved benchmarks of context-parallel attention, forward + backward (docs/design.md, Benchmarks).

``python benchmarks/bench_context_parallel.py [--nproc 4] [--rounds 40] [--warmup 5] [--quick] [--json PATH]``

Spawns ``--nproc`` local gloo ranks (FileStore rendezvous, one intra-op thread each). Each case
is a pair of variants timed in the same rounds, interleaved with alternating order and a barrier
before each op (per-op time = max over ranks); reported: median [q1, q3] of the per-round ratios.

- ``overlap-comm``: :func:`ring_attention` with ``overlap=True`` over ``overlap=False`` (post,
  wait, then compute), small head dim and few tokens per rank: transfers rival compute
  (goal <= 0.93).
- ``overlap-compute``: the same pair where compute dominates (goal <= 1.02: overlap costs nothing).
- ``zigzag-causal``: causal ring attention in the zigzag layout over a naive contiguous ring
  (goal <= 0.8: the slowest contiguous rank does ``R`` blocks, zigzag ranks ``R + 1/2``).
- ``ulysses-unaligned``: :func:`ulysses_attention` with ``S`` and ``N`` not divisible by ``R`` over
  an aligned size, each time divided by the bytes its all-to-alls move (ledger, all ranks)
  (goal <= 1.1: uneven splits cost no more per byte).

Checked before timing: overlap and no-overlap results are bitwise equal (output and dq, dk,
dv); zigzag and contiguous outputs, gathered to global order, equal full attention
(``F.scaled_dot_product_attention``, float32 rtol 1e-4); Ulysses outputs equal full attention.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _paired import add_timing_args, cell, check_rounds, print_row, quantiles, run_and_report, time_interleaved

GOALS = {"overlap-comm": 0.93, "overlap-compute": 1.02, "zigzag-causal": 0.8, "ulysses-unaligned": 1.1}


def _sizes(quick: bool):
    """(case, kind, params) with params of each variant: (B, S, N, D) and flags."""
    s = 1 if quick else 2
    return [
        ("overlap-comm", "ring", [dict(B=1, S=1024 * s, N=16, D=8, causal=False, overlap=o, layout="zigzag") for o in (True, False)]),
        ("overlap-compute", "ring", [dict(B=1, S=2048 * s, N=4, D=64, causal=True, overlap=o, layout="zigzag") for o in (True, False)]),
        ("zigzag-causal", "ring", [dict(B=1, S=2048 * s, N=4, D=64, causal=True, overlap=True, layout=lay) for lay in ("zigzag", "contiguous")]),
        ("ulysses-unaligned", "ulysses", [dict(B=1, S=2048 * s - 3, N=7, D=64, causal=True), dict(B=1, S=2048 * s, N=8, D=64, causal=True)]),
    ]


def _full(B, S, N, D, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, N, D, generator=gen) for _ in range(4)]


def _reference(q, k, v, causal):
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal))


def _prepare(kind, p, pg, seed):
    """The timed callable (fwd + bwd) of one variant, its global token indices and its full inputs."""
    from shardkit import balanced_split_sizes
    from shardkit._shapes import split_offsets
    from shardkit.comm import CommLedger
    from shardkit.context_parallel import ring_attention, ulysses_attention, zigzag_positions

    rank, R = dist.get_rank(pg), dist.get_world_size(pg)
    B, S, N, D = p["B"], p["S"], p["N"], p["D"]
    full = _full(B, S, N, D, seed)
    if kind == "ring" and p["layout"] == "zigzag":
        pos = zigzag_positions(S, R, rank)
    else:
        sizes = balanced_split_sizes(S, R)
        pos = torch.arange(split_offsets(sizes)[rank], split_offsets(sizes)[rank] + sizes[rank])
    q, k, v = (t[:, pos].contiguous().requires_grad_() for t in full[:3])
    dout = full[3][:, pos].contiguous()

    def fn():
        for t in (q, k, v):
            t.grad = None
        if kind == "ring":
            out = ring_attention(q, k, v, pg, causal=p["causal"], seq_len=S, layout=p["layout"], overlap=p["overlap"])
        else:
            out = ulysses_attention(q, k, v, pg, causal=p["causal"], seq_len=S)
        out.backward(dout)
        return out.detach(), [t.grad for t in (q, k, v)]

    with CommLedger() as ledger:
        fn()
    moved = torch.tensor([float(ledger.bytes_sent())])
    dist.all_reduce(moved, group=pg)
    return fn, pos, full, moved.item()


def _check(case, kind, variants, preps, pg) -> None:
    """Every variant agrees with full attention; overlap on / off are bitwise equal."""
    ok = True
    results = [prep[0]() for prep in preps]
    for p, (fn, pos, full, _), (out, _) in zip(variants, preps, results):
        want = _reference(*full[:3], p["causal"])[:, pos]
        ok &= torch.allclose(out, want, rtol=1e-4, atol=1e-4)
    if case.startswith("overlap"):
        (o1, g1), (o2, g2) = results
        ok &= torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
    if flag.item() == 0:
        raise AssertionError(f"{case}: a variant disagrees with full attention (or overlap changed the result)")


def _body(rank: int, pg, args) -> list[dict]:
    results = []
    for n, (case, kind, variants) in enumerate(_sizes(args.quick)):
        t0 = time.perf_counter()
        preps = [_prepare(kind, p, pg, seed=11 + n) for p in variants]
        _check(case, kind, variants, preps, pg)
        times = time_interleaved([prep[0] for prep in preps], pg, args.warmup, args.rounds)
        results.append(dict(case=case, variants=variants, bytes_moved=[prep[3] for prep in preps], times_s=times))
        if rank == 0:
            print(f"{case}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


def summarize(results):
    rows = []
    for res in results:
        (a, b), (ba, bb) = res["times_s"], res["bytes_moved"]
        if res["case"] == "ulysses-unaligned":  # time per byte moved
            ratios = [(x / ba) / (y / bb) for x, y in zip(a, b)]
        else:
            ratios = [x / y for x, y in zip(a, b)]
        rows.append(dict(case=res["case"], variants=res["variants"],
                         ms=[quantiles([1e3 * t for t in a])["median"], quantiles([1e3 * t for t in b])["median"]],
                         bytes_moved=res["bytes_moved"], ratio=quantiles(ratios), goal=GOALS[res["case"]]))
    return rows


def _label(p):
    flags = [k if v is True else (f"no-{k}" if v is False else str(v)) for k, v in p.items() if k not in ("B", "S", "N", "D")]
    return f"B{p['B']} S{p['S']} N{p['N']} D{p['D']} " + ",".join(flags)


def render(rows, args, elapsed):
    print(f"context-parallel attention fwd+bwd, float32, gloo, R={args.nproc}, {args.rounds} rounds after {args.warmup} warm-up, "
          f"median [q1, q3] of per-round ratios A/B, {elapsed:.0f} s")
    print_row("case", "A", "B", "A ms", "B ms", "ratio A/B", "goal", "met")
    for r in rows:
        q = r["ratio"]
        print_row(r["case"], _label(r["variants"][0]), _label(r["variants"][1]), f"{r['ms'][0]:.2f}",
                  f"{r['ms'][1]:.2f}", cell(q) + (" per byte" if r["case"] == "ulysses-unaligned" else ""),
                  f"<= {r['goal']}", "yes" if q["median"] <= r["goal"] else "NO")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    add_timing_args(p)
    p.add_argument("--quick", action="store_true", help="half the sequence lengths")
    p.add_argument("--json", metavar="PATH", help="write the per-round times and the summary as JSON")
    args = p.parse_args(argv)
    check_rounds(p, args)
    meta = dict(nproc=args.nproc, rounds=args.rounds, warmup=args.warmup)
    return run_and_report(args, _body, args.nproc, summarize, render, meta, prefix="shardkit-bench-cp-")


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
