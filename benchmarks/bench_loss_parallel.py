"""Paired benchmark: vocab-parallel cross entropy vs gathering the logits (docs/design.md, Benchmarks).

``python benchmarks/bench_loss_parallel.py [--nproc 2,4] [--tokens 2048] [--vocab 32000]
[--rounds 40] [--warmup 5] [--quick] [--json PATH]``

For each group size R (local gloo ranks, FileStore rendezvous, one intra-op thread each; R=4 on
a 2-core machine is oversubscribed) every rank holds float32 logits ``[T, V / R]`` (torch.chunk
layout) and replicated labels, and runs loss forward + backward in two variants:

- ``parallel``: :func:`shardkit.tensor_parallel.loss.vocab_parallel_cross_entropy` on the local
  block (two all-reduces of O(T) in forward, nothing in backward);
- ``gathered``: ``gather_forward_split_backward`` to the full ``[T, V]`` logits, then
  ``F.cross_entropy`` (the backward keeps this rank's block of the replicated gradient).

Both are checked first: same loss and same local gradient (float32, rtol 1e-5).

Peak memory: one untimed step of each variant under ``torch.profiler(profile_memory=True)``;
the profiler's CPU allocator reporter gives the bytes of tensors allocated since profiling began
and still live after every allocation, so its maximum is the step's peak of extra tensor memory
(inputs already alive are not counted; the gradient written into ``.grad`` is). It sees every
tensor, including communication buffers, but not gloo's internal staging memory; RSS or
tracemalloc would not measure torch tensors soundly (caching, mmap thresholds). Reported per
variant as the max over ranks, with the full-logits size ``T x V x 4`` bytes for scale.

Time: variants interleaved with alternating order, a barrier before each, per-op time = max
over ranks, median [q1, q3] of the per-round ratio parallel / gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _paired import (
    add_timing_args, cell, check_rounds, dump_json, print_row, quantiles, ratio_q, run_ranks, time_interleaved
)

VARIANTS = ("parallel", "gathered")


def _chunk_sizes(vocab: int, world: int) -> list[int]:
    sizes = [c.numel() for c in torch.arange(vocab).chunk(world)]
    return sizes + [0] * (world - len(sizes))


def _prepare(tokens: int, vocab: int, pg):
    from shardkit import gather_forward_split_backward
    from shardkit.tensor_parallel.loss import vocab_parallel_cross_entropy

    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    sizes = _chunk_sizes(vocab, world)
    gen = torch.Generator().manual_seed(11)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = -100
    # Each rank draws only its own block (a [T, V] float32 tensor per rank would be the very
    # memory the parallel loss avoids); the blocks of all ranks together are the full logits.
    local = torch.randn(tokens, sizes[rank], generator=torch.Generator().manual_seed(100 + rank)) * 3
    local.requires_grad_()

    def parallel():
        local.grad = None
        loss = vocab_parallel_cross_entropy(local, labels, pg, vocab_sizes=sizes)
        loss.backward()
        return loss.detach()

    def gathered():
        local.grad = None
        loss = F.cross_entropy(gather_forward_split_backward(local, pg, -1, sizes), labels)
        loss.backward()
        return loss.detach()

    return dict(parallel=parallel, gathered=gathered), local


def _check(fns, local, pg) -> dict[str, int]:
    """Both variants give the same loss and local gradient; returns the bytes each sends."""
    from shardkit import CommLedger

    out, sent = {}, {}
    for name, fn in fns.items():
        with CommLedger() as led:
            loss = fn()
        out[name] = (loss, local.grad.clone())
        sent[name] = led.bytes_sent()
    (lp, gp), (lg, gg) = out["parallel"], out["gathered"]
    # float32, different summation orders: loss and gradient agree to rtol 1e-5 (gradient in norm:
    # its entries span many magnitudes, elementwise rtol would judge the roundoff of tiny ones).
    ok = torch.allclose(lp, lg, rtol=1e-5, atol=0) and bool((gp - gg).norm() <= 1e-5 * gg.norm())
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
    if not flag.item():
        raise AssertionError(f"rank {dist.get_rank(pg)}: parallel and gathered losses or gradients differ")
    return sent


def _peak_bytes(fn, trace_path: str) -> int:
    """Peak of live tensor bytes allocated during one call of ``fn`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    os.remove(trace_path)
    if not events:
        return 0
    first = min(events, key=lambda e: e["ts"])["args"]
    base = first["Total Allocated"] - first["Bytes"]  # what the reporter counted before the call
    return max(e["args"]["Total Allocated"] for e in events) - base


def _body(rank: int, pg, args) -> dict:
    world = dist.get_world_size(pg)
    fns, local = _prepare(args.tokens, args.vocab, pg)
    sent = _check(fns, local, pg)
    peaks = {}
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-loss-trace-") as tmp:
        for name, fn in fns.items():
            local.grad = None
            dist.barrier(group=pg)
            peaks[name] = _peak_bytes(fn, os.path.join(tmp, f"trace{rank}.json"))
    peak = torch.tensor([peaks[n] for n in VARIANTS] + [sent[n] for n in VARIANTS], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=pg)
    times = time_interleaved(fns, pg, args.warmup, args.rounds)
    vals = [int(v) for v in peak.tolist()]
    return dict(world=world, peak_bytes=dict(zip(VARIANTS, vals[:2])), sent_bytes=dict(zip(VARIANTS, vals[2:])),
                times_s=times)


def summarize(res: dict, tokens: int, vocab: int) -> dict:
    t, p = res["times_s"], res["peak_bytes"]
    return dict(
        world=res["world"], full_logits_bytes=tokens * vocab * 4, peak_bytes=p, sent_bytes=res["sent_bytes"],
        peak_ratio=p["parallel"] / p["gathered"],
        ms={k: quantiles([1e3 * v for v in t[k]])["median"] for k in VARIANTS},
        time_ratio=ratio_q(t["parallel"], t["gathered"]),
    )


def render(rows: list[dict], args, elapsed: float) -> None:
    mib = 2.0**20
    print(f"vocab-parallel cross entropy fwd+bwd vs gathered logits, T={args.tokens} tokens, V={args.vocab}, float32, "
          f"gloo, {args.rounds} rounds after {args.warmup} warm-up, median [q1, q3] of per-round ratios, "
          f"{elapsed:.0f} s")
    head = ("R", "full logits MiB", "peak parallel MiB", "peak gathered MiB", "peak ratio", "sent parallel KiB",
            "sent gathered MiB", "parallel ms", "gathered ms", "time parallel/gathered")
    print_row(*head)
    for r in rows:
        print_row(
            str(r["world"]), f"{r['full_logits_bytes'] / mib:.1f}", f"{r['peak_bytes']['parallel'] / mib:.1f}",
            f"{r['peak_bytes']['gathered'] / mib:.1f}", f"{r['peak_ratio']:.3f}",
            f"{r['sent_bytes']['parallel'] / 1024:.1f}", f"{r['sent_bytes']['gathered'] / mib:.1f}",
            f"{r['ms']['parallel']:.1f}", f"{r['ms']['gathered']:.1f}", cell(r["time_ratio"]),
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4],
                   help="comma-separated group sizes, e.g. 2,4")
    p.add_argument("--tokens", type=int, default=2048, help="B x S tokens")
    p.add_argument("--vocab", type=int, default=32000)
    add_timing_args(p)
    p.add_argument("--quick", action="store_true", help="T=128 tokens (same V, rounds and group sizes)")
    p.add_argument("--json", metavar="PATH", help="write the per-round times and the summary as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens = 128
    check_rounds(p, args)
    t0 = time.perf_counter()
    rows, raw = [], []
    for world in args.nproc:
        res = run_ranks(_body, world, args, prefix="shardkit-bench-loss-")
        raw.append(res)
        rows.append(summarize(res, args.tokens, args.vocab))
        print(f"R={world}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    render(rows, args, time.perf_counter() - t0)
    dump_json(args.json, dict(args=dict(tokens=args.tokens, vocab=args.vocab, rounds=args.rounds, warmup=args.warmup),
                              summary=rows, raw=raw))
    return 0


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
