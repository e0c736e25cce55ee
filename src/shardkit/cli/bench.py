"""``shardkit bench``: paired, interleaved benchmark of :func:`shardkit.all_to_all` (docs/design.md, Benchmarks).

Launches ``--nproc`` local gloo ranks (spawn, FileStore, one intra-op thread each), runs
:mod:`shardkit.cli._bench_all_to_all` on them and reports, per size and direction, the median
of per-round time ratios with their spread (IQR; p10 and p90 in the JSON):

- shardkit / bare ``all_to_all_single`` on a pre-laid buffer (goal <= 1.5),
- shardkit / list ``all_to_all`` + ``torch.cat`` (MindSpeed-MM unaligned path, goal <= 0.6),
- unaligned / aligned heads, time per byte moved (goal <= 1.1),

and shardkit's bus bandwidth with the nccl-tests all_to_all factor ``(n - 1) / n``.
Absolute times on shared machines swing by tens of percent between runs; the paired ratios are
the result, the times only context.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm import checks
from ._bench_all_to_all import DIRECTIONS, BenchConfig, run_cases

__all__ = ["add_bench_parser", "run_bench", "summarize", "main"]

DEFAULT_SIZES = "16K,64K,256K,1M,8M"
# Upper bounds on the median ratios, with the tag the goals column uses.
GOALS = {"vs_bare": 1.5, "vs_listcat": 0.6, "unaligned_per_byte": 1.1}
GOAL_TAGS = {"vs_bare": "a", "vs_listcat": "b", "unaligned_per_byte": "u"}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"16K"``, ``"256KiB"``, ``"8M"`` or ``"4096"`` to bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 16K, 256KiB, 8M or a byte count")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_size(n: int) -> str:
    """Bytes as ``"16 KiB"`` / ``"8 MiB"`` where exact, else ``"N B"``."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "bench",
        help="paired, interleaved all_to_all benchmark on local gloo ranks",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--rounds", type=int, default=300, help="timed rounds per case (>= 40 for docs/design.md, Benchmarks; default 300)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up rounds per case (default 5)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"local input bytes, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--directions", default=",".join(DIRECTIONS), help="heads (scatter N, gather S) and/or seq (scatter S, gather N)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--heads", type=int, default=16, help="aligned head count, divisible by --nproc (default 16)")
    p.add_argument("--unaligned-heads", type=int, default=15, help="unaligned head count (default 15)")
    p.add_argument("--head-dim", type=int, default=64, help="D of [B, S, N, D] (default 64)")
    p.add_argument("--json", metavar="PATH", help="also write the summary and every per-round time here")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")
    p.set_defaults(func=run_bench)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate the options and freeze them into a :class:`BenchConfig`."""
    problems = []
    try:
        sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s.strip())
    except argparse.ArgumentTypeError as e:
        sizes, problems = (), [str(e)]
    directions = tuple(d.strip() for d in args.directions.split(",") if d.strip())
    bad = [d for d in directions if d not in DIRECTIONS]
    if bad:
        problems.append(f"unknown direction(s) {bad}; choose from {list(DIRECTIONS)}")
    if args.nproc < 2:
        problems.append("--nproc must be >= 2")
    elif args.heads % args.nproc or args.unaligned_heads % args.nproc == 0:
        problems.append(f"--heads ({args.heads}) must divide by --nproc ({args.nproc}) and --unaligned-heads ({args.unaligned_heads}) must not")
    if args.rounds < 1 or args.warmup < 0 or (not sizes and not problems) or not directions:
        problems.append("need --rounds >= 1, --warmup >= 0, at least one size and one direction")
    if problems:
        raise SystemExit("shardkit bench: " + "; ".join(problems))
    return BenchConfig(
        sizes=sizes, directions=directions, rounds=args.rounds, warmup=args.warmup, nproc=args.nproc,
        heads=args.heads, unaligned_heads=args.unaligned_heads, head_dim=args.head_dim, progress=not args.quiet,
    )


def _rank_main(rank: int, cfg: BenchConfig, store_path: str, result_path: str) -> None:
    """Entry point of one spawned rank: gloo over a FileStore, one thread, results from rank 0."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, cfg.nproc)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.nproc, timeout=timedelta(seconds=120))
    try:
        checks(False)  # the opt-in metadata all-gather is not part of the op being measured
        results = run_cases(cfg, dist.group.WORLD)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def launch(cfg: BenchConfig) -> list[dict]:
    """Run the benchmark on ``cfg.nproc`` spawned ranks; rank 0's per-case results."""
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        torch.multiprocessing.start_processes(
            _rank_main, args=(cfg, os.path.join(tmp, "store"), result_path), nprocs=cfg.nproc, start_method="spawn"
        )
        with open(result_path) as f:
            return json.load(f)


def _spread(values: list[float]) -> dict[str, float]:
    q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64))
    return dict(zip(("p10", "q1", "median", "q3", "p90"), q.tolist()))


def _ratios(num: list[float], den: list[float], scale: float = 1.0) -> dict[str, float]:
    return _spread([scale * a / b for a, b in zip(num, den)])


def summarize(results: list[dict]) -> list[dict]:
    """One row per (size, direction, aligned/unaligned): ratio stats, bus bandwidth, goals."""
    rows = []
    for res in results:
        aligned = res["aligned"]
        for label in ("aligned", "unaligned"):
            case, t = res[label], res[label]["times_s"]
            n = res["nproc"]
            t_med = _spread(t["shardkit"])["median"]
            row = {
                "size": res["size"], "direction": res["direction"], "variant": label,
                "heads": case["shape_global"][2], "shape_global": case["shape_global"],
                "shardkit_ms": 1e3 * t_med,
                "vs_bare": _ratios(t["shardkit"], t["bare"]),
                "vs_listcat": _ratios(t["shardkit"], t["listcat"]),
                # nccl-tests: algbw = per-rank buffer bytes (mean over ranks) / time, busbw = algbw * (n - 1) / n
                "busbw_GBps": case["bytes_group"] / n / t_med * (n - 1) / n / 1e9,
            }
            if label == "unaligned":  # time per byte moved, unaligned over aligned, same round
                scale = aligned["bytes_group"] / case["bytes_group"]
                row["unaligned_per_byte"] = _ratios(t["shardkit"], aligned["times_s"]["shardkit"], scale)
            row["missed"] = [GOAL_TAGS[key] for key, bound in GOALS.items() if key in row and row[key]["median"] > bound]
            rows.append(row)
    return rows


def _cell(stats: dict | None) -> str:
    return "-" if stats is None else f"{stats['median']:.2f} ({stats['q1']:.2f}-{stats['q3']:.2f})"


def render(rows: list[dict], cfg: BenchConfig, elapsed: float) -> None:
    """Print the summary table (rich) and the goals legend."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 132)
    table = Table(title=f"shardkit.all_to_all, {cfg.nproc} ranks gloo, {cfg.rounds} rounds (+{cfg.warmup} warm-up): "
                        "median (IQR) of per-round ratios")
    for name, justify in (("size", "right"), ("scatter", "left"), ("N", "right"), ("shardkit ms", "right"),
                          ("(a) sk/bare", "right"), ("(b) sk/list+cat", "right"), ("unal/al per B", "right"),
                          ("busbw GB/s", "right"), ("goals", "left")):
        table.add_column(name, justify=justify)
    directions = {"heads": "scatter N", "seq": "scatter S"}
    for row in rows:
        status = "PASS" if not row["missed"] else "MISS " + ",".join(row["missed"])
        table.add_row(format_size(row["size"]), directions[row["direction"]], str(row["heads"]), f"{row['shardkit_ms']:.3f}",
                      _cell(row["vs_bare"]), _cell(row["vs_listcat"]), _cell(row.get("unaligned_per_byte")),
                      f"{row['busbw_GBps']:.2f}", status)
    console.print(table)
    console.print(f"goals on the medians: (a) sk/bare <= {GOALS['vs_bare']}, (b) sk/list+cat <= {GOALS['vs_listcat']}, "
                  f"(u) unaligned/aligned time per byte <= {GOALS['unaligned_per_byte']}; size = aligned local input "
                  f"bytes (N=15 runs the same S); p10/p90 in the JSON; total {elapsed:.0f} s")
    console.print("(b) at N=15: gloo rejects a list all_to_all of unequal tensors, so the reference exchanges "
                  "its chunks with batch_isend_irecv per peer (what NCCL's list all_to_all does)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``bench`` options; print it, optionally write JSON."""
    cfg = config_from_args(args)
    t0 = time.perf_counter()
    results = launch(cfg)
    elapsed = time.perf_counter() - t0
    rows = summarize(results)
    render(rows, cfg, elapsed)
    if args.json:
        meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "elapsed_s": elapsed, "goals": GOALS}
        with open(args.json, "w") as f:
            json.dump({"config": vars(cfg), "meta": meta, "rows": rows, "cases": results}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``benchmarks/bench_all_to_all.py``): the ``bench`` options only."""
    parser = argparse.ArgumentParser(prog="bench_all_to_all")
    sub = parser.add_subparsers(dest="command")
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
