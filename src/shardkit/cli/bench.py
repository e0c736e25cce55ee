"""``shardkit bench``: every benchmark case of :mod:`shardkit.bench`, one method, one output.

``shardkit bench [--quick] [--cases a,b] [--rounds 40] [--warmup 5] [--out DIR]`` runs the
selected cases on local gloo ranks (one spawned world per world size), prints the markdown table
and writes ``DIR/bench.json``, ``DIR/bench.md``, ``DIR/bench_ratios.png`` and
``DIR/bench_busbw.png``. ``--quick`` runs every case at its small sizes (under 3 minutes on 2
cores); the full suite takes under 20.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..bench import CASES, Settings, run_bench, write_outputs
from ..bench.report import environment
from .commands import COMMANDS

__all__ = ["add_bench_parser", "run"]


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an ``argparse`` subparsers object; returns its parser."""

    listing = "; ".join(f"{k}: {v.what} ({v.nproc} ranks)" for k, v in CASES.items())
    p = subparsers.add_parser(
        "bench",
        help=COMMANDS["bench"],
        description=__doc__.split("\n\n")[0] + " Cases: " + listing,
    )
    p.add_argument("--quick", action="store_true", help="small sizes of every case (< 3 min)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (default: all)")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds per case (>= 40, default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up rounds (>= 5, default 5)")
    p.add_argument("--out", default="bench-out", help="output folder (default ./bench-out)")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the selected cases and write the outputs; returns 0 (a failed check raises)."""

    if args.rounds < 40 or args.warmup < 5:
        raise SystemExit("shardkit bench: docs/design.md (Benchmarks) needs --rounds >= 40 and --warmup >= 5")
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    settings = Settings(rounds=args.rounds, warmup=args.warmup, quick=args.quick)
    t0 = time.perf_counter()
    try:
        records = run_bench(names, settings, progress=not args.quiet)
    except ValueError as exc:
        raise SystemExit(f"shardkit bench: {exc}") from None

    argv = (["--quick"] if args.quick else []) + (["--cases", args.cases] if set(names) != set(CASES) else [])
    argv += [] if args.rounds == 40 else ["--rounds", str(args.rounds)]
    env = dict(environment(argv), elapsed_s=round(time.perf_counter() - t0, 1))
    doc = write_outputs(
        records, dict(rounds=args.rounds, warmup=args.warmup, quick=args.quick, cases=names), env, args.out
    )
    with open(f"{args.out}/bench.md") as f:
        sys.stdout.write(f.read())
    print(
        f"\n{len(records)} records in {env['elapsed_s']:.0f} s; wrote {args.out}/bench.json, bench.md, "
        + ", ".join(p.rsplit("/", 1)[-1] for p in doc["plots"])
    )
    return 0
