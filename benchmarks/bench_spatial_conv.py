"""Paired, interleaved benchmark of ``spatial_conv2d`` forward + backward (docs/design.md, Benchmarks).

``python benchmarks/bench_spatial_conv.py [--nproc 2] [--rounds 40] [--warmup 5] [--quick] [--json PATH]``

Spawns ``--nproc`` local gloo ranks (FileStore rendezvous, one intra-op thread each). For every
size (global ``[B, C, H, W]`` float32, 3x3 conv ``C -> C`` with padding 1, W sharded, balanced
split) each round times, interleaved with alternating order and a barrier before each op
(per-op time = max over ranks):

- ``spatial``: :func:`shardkit.spatial.spatial_conv2d` forward + backward, overlapped (the
  default: interior outputs computed while the halo exchange is in flight, interior input and
  weight gradients while the halo gradients travel back; weight / bias gradient all-reduce);
- ``sequential``: the same with ``overlap=False`` (exchange, then convolve);
- ``gather``: all-gather the full input, full ``F.conv2d``, keep the local outputs, backward
  (reduce-scatter of the input gradient) and the same weight / bias gradient all-reduce;
- the parts alone: ``halo`` (:func:`halo_exchange` forward + backward), ``conv`` (local
  ``F.conv2d`` forward + backward on a pre-exchanged slab), ``allreduce`` (the parameter
  gradient all-reduce), and ``halo_fwd`` (one forward exchange, for the bus bandwidth).

Reported: median [q1, q3] of per-round ratios spatial / sequential, spatial / (halo + conv +
allreduce) (the parts measured separately, summed per round) and spatial / gather; the halo
share of (halo + conv), which bounds what overlapping can save; the halo bus bandwidth
(send/recv factor 1: the largest per-rank bytes sent by one forward exchange over its time).
Every case is checked before timing: output, input gradient and parameter gradients of
``spatial`` and ``sequential`` equal the ``gather`` baseline (float32, rtol 1e-4), and the
parts compute the same. ``--quick``: the smallest size only (still >= 40 rounds).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _paired import add_timing_args, cell, check_rounds, print_row, quantiles, ratio_q, run_and_report, time_interleaved

SIZES = ((1, 32, 64, 256), (1, 32, 128, 512), (1, 32, 256, 1024))
VARIANTS = ("spatial", "sequential", "gather", "halo", "conv", "allreduce", "halo_fwd")


def _prepare(shape, pg):
    """Inputs, weights and the timed callables of one size on this rank."""
    from shardkit import all_gather, balanced_split_sizes
    from shardkit._shapes import split_offsets
    from shardkit.spatial import halo_exchange, spatial_conv2d

    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    B, C, H, W = shape
    gen = torch.Generator().manual_seed(7 + W)
    x_full = torch.randn(shape, generator=gen)
    w0 = torch.randn(C, C, 3, 3, generator=gen) / (3 * C**0.5)
    b0 = torch.randn(C, generator=gen)
    dy_full = torch.randn(shape, generator=gen)
    sizes = balanced_split_sizes(W, world)
    off, n = split_offsets(sizes)[rank], sizes[rank]
    x = x_full.narrow(3, off, n).contiguous().requires_grad_()
    dy = dy_full.narrow(3, off, n).contiguous()
    del x_full, dy_full
    params = {f"{name}_{t}": v.clone().requires_grad_() for name in ("spatial", "sequential", "gather", "conv")
              for t, v in (("w", w0), ("b", b0))}
    slab = halo_exchange(x.detach(), pg, 3, 1, 1, sizes=sizes).contiguous().requires_grad_()
    dslab = torch.randn(slab.shape, generator=gen)
    flat_grads = torch.cat([w0.reshape(-1), b0])

    def zero(*ts):
        for t in ts:
            t.grad = None

    def spatial(name="spatial", overlap=True):
        zero(x, params[f"{name}_w"], params[f"{name}_b"])
        y = spatial_conv2d(x, params[f"{name}_w"], params[f"{name}_b"], pg, 3, padding=1, sizes=sizes, overlap=overlap)
        y.backward(dy)
        return y

    def sequential():
        return spatial("sequential", overlap=False)

    def gather():
        zero(x, params["gather_w"], params["gather_b"])
        xf = all_gather(x, pg, 3, sizes=sizes)
        y = F.conv2d(xf, params["gather_w"], params["gather_b"], padding=1).narrow(3, off, n)
        y.backward(dy)
        w, b = params["gather_w"], params["gather_b"]
        flat = torch.cat([w.grad.reshape(-1), b.grad])
        dist.all_reduce(flat, group=pg)
        w.grad.copy_(flat[: w.numel()].view(w.shape))
        b.grad.copy_(flat[w.numel():])
        return y

    def halo():
        zero(x)
        h = halo_exchange(x, pg, 3, 1, 1, sizes=sizes)
        h.backward(dslab)
        return h

    def conv():
        zero(slab, params["conv_w"], params["conv_b"])
        y = F.conv2d(slab, params["conv_w"], params["conv_b"], padding=(1, 0))
        y.backward(dy)
        return y

    def allreduce():
        buf = flat_grads.clone()
        dist.all_reduce(buf, group=pg)
        return buf

    def halo_fwd():
        with torch.no_grad():
            return halo_exchange(x, pg, 3, 1, 1, sizes=sizes)

    fns = dict(spatial=spatial, sequential=sequential, gather=gather, halo=halo, conv=conv, allreduce=allreduce,
               halo_fwd=halo_fwd)
    # Bytes this rank sends in one forward exchange: one column to each existing neighbour.
    halo_bytes = B * C * H * 4 * ((rank > 0) + (rank < world - 1)) if n else 0
    return fns, x, params, slab, halo_bytes


def _check(fns, x, params, slab, pg) -> None:
    """spatial == sequential == gather (output, input grad, weight / bias grads); parts agree with spatial."""
    rank = dist.get_rank(pg)
    yq = fns["sequential"]()
    gx_q = x.grad.clone()
    ys = fns["spatial"]()
    gx_s = x.grad.clone()
    yg = fns["gather"]()
    gx_g = x.grad.clone()
    yc = fns["conv"]()
    h = fns["halo_fwd"]()

    def close(a, b):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4)

    checks = {
        "output": close(ys.detach(), yg.detach()),
        "input_grad": close(gx_s, gx_g),
        "weight_grad": close(params["spatial_w"].grad, params["gather_w"].grad),
        "bias_grad": close(params["spatial_b"].grad, params["gather_b"].grad),
        "sequential_output": close(yq.detach(), yg.detach()),
        "sequential_input_grad": close(gx_q, gx_g),
        "sequential_weight_grad": close(params["sequential_w"].grad, params["gather_w"].grad),
        "sequential_bias_grad": close(params["sequential_b"].grad, params["gather_b"].grad),
        "parts_output": close(ys.detach(), yc.detach()),
        "halo": torch.equal(h, slab.detach()),
    }
    bad = [k for k, ok in checks.items() if not ok]
    ok = torch.tensor([0 if bad else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
    if bad or ok.item() == 0:
        raise AssertionError(f"rank {rank}: mismatched {bad or 'on another rank'}")


def _body(rank: int, pg, args) -> list[dict]:
    results = []
    for shape in args.sizes:
        t0 = time.perf_counter()
        fns, x, params, slab, halo_bytes = _prepare(shape, pg)
        _check(fns, x, params, slab, pg)
        hb = torch.tensor([halo_bytes])
        dist.all_reduce(hb, op=dist.ReduceOp.MAX, group=pg)
        results.append(dict(shape=list(shape), halo_bytes=int(hb.item()), local_shape=list(x.shape),
                            times_s=time_interleaved(fns, pg, args.warmup, args.rounds)))
        if rank == 0:
            print(f"{shape}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        t = res["times_s"]
        parts = [h + c for h, c in zip(t["halo"], t["conv"])]
        parts_ar = [p + a for p, a in zip(parts, t["allreduce"])]
        rows.append(dict(
            shape=res["shape"], local_shape=res["local_shape"], halo_bytes=res["halo_bytes"],
            ms={k: quantiles([1e3 * v for v in t[k]])["median"] for k in VARIANTS},
            spatial_over_sequential=ratio_q(t["spatial"], t["sequential"]),
            sequential_over_parts_allreduce=ratio_q(t["sequential"], parts_ar),
            spatial_over_parts_allreduce=ratio_q(t["spatial"], parts_ar),
            spatial_over_gather=ratio_q(t["spatial"], t["gather"]),
            halo_share=ratio_q(t["halo"], parts),
            halo_busbw_GBps=quantiles([res["halo_bytes"] / v / 1e9 for v in t["halo_fwd"]]),
        ))
    return rows


def render(rows: list[dict], args, elapsed: float) -> None:
    print(f"spatial_conv2d fwd+bwd, 3x3 pad 1, W-sharded, float32, gloo, R={args.nproc}, "
          f"{args.rounds} rounds after {args.warmup} warm-up, median [q1, q3] of per-round ratios, {elapsed:.0f} s; "
          "spatial = overlapped, sequential = overlap=False, parts = halo + conv + allred measured apart")
    head = ("global [B,C,H,W]", "halo B/rank", "spatial ms", "sequential ms", "gather ms", "halo ms", "conv ms",
            "allred ms", "spatial/sequential", "spatial/parts", "sequential/parts", "spatial/gather",
            "halo/(halo+conv)", "halo busbw GB/s")
    print_row(*head)
    for r in rows:
        ms = r["ms"]
        print_row(
            "x".join(map(str, r["shape"])), f"{r['halo_bytes'] / 1024:g} KiB", f"{ms['spatial']:.2f}",
            f"{ms['sequential']:.2f}", f"{ms['gather']:.2f}", f"{ms['halo']:.2f}", f"{ms['conv']:.2f}",
            f"{ms['allreduce']:.2f}", cell(r["spatial_over_sequential"]), cell(r["spatial_over_parts_allreduce"]),
            cell(r["sequential_over_parts_allreduce"]), cell(r["spatial_over_gather"]), cell(r["halo_share"]),
            cell(r["halo_busbw_GBps"]),
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    add_timing_args(p)
    p.add_argument("--sizes", type=lambda s: tuple(tuple(int(v) for v in t.split("x")) for t in s.split(",")),
                   default=SIZES, help="comma-separated BxCxHxW, e.g. 1x32x64x256,1x32x128x512")
    p.add_argument("--quick", action="store_true", help="the smallest size only")
    p.add_argument("--json", metavar="PATH", help="write the per-round times and the summary as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = args.sizes[:1]
    check_rounds(p, args)
    meta = dict(nproc=args.nproc, rounds=args.rounds, warmup=args.warmup)
    return run_and_report(args, _body, args.nproc, summarize, render, meta, prefix="shardkit-bench-conv-")


if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
