"""``shardkit bench``: every benchmark case of :mod:`shardkit.bench`, one method, one output.

``shardkit bench [--quick] [--cases a,b] [--rounds 40] [--warmup 5] [--out DIR] [--device cpu|cuda]``
runs the selected cases, prints the markdown table and writes ``DIR/bench.json``,
``DIR/bench.md`` and one chart per unit: ``DIR/bench_ratios.png``, ``DIR/bench_us.png`` (host
microseconds) and ``DIR/bench_busbw.png`` (:mod:`shardkit.bench.report`). ``--device cpu`` (the
default) runs them on local gloo ranks (one spawned world per world size); ``--quick`` runs one
configuration of every case at small sizes (2 min 55 s on 2 cores at load 4-8, each case's wall
and CPU seconds printed as it ends); the full suite takes under 20. Under
``torchrun`` they run in its world (``--device cuda``: NCCL, one GPU a rank, CUDA events around
every timed op): ``torchrun --standalone --nproc-per-node N -m shardkit bench --device cuda``;
a case needing another world size is skipped, its reason printed and written.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time

from ..bench import CASES, LAUNCH, Settings, run_bench, run_in_world, torchrun_env, write_outputs
from ..bench.report import backend_name, environment
from .commands import COMMANDS

__all__ = ["add_bench_parser", "run"]

# `shardkit bench --help` is read in a terminal: plain text here, no reST markup (the docstring
# above is for the API reference).
DESCRIPTION = textwrap.fill(
    "Paired, interleaved benchmarks of every axis against its peers (docs/design.md, Benchmarks): "
    "runs the selected cases, prints a markdown table and writes DIR/bench.json, DIR/bench.md and "
    "PNG charts, one per unit (bench_ratios.png: ratios; bench_us.png: host microseconds; "
    "bench_busbw.png: bus bandwidth). On the CPU every case runs on local gloo ranks (one spawned "
    f"world per world size); under torchrun the cases run in its world: `{LAUNCH}`. A case needing "
    "another world size is skipped, its reason printed and written.",
    width=100,
)
QUICK_WHAT = "one configuration of each case at small sizes (docs/design.md, Benchmarks)"
QUICK_TIME = "2 min 55 s measured on 2 cores at load 4-8"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an ``argparse`` subparsers object; returns its parser."""

    def ranks(spec) -> str:
        other = [w for w in spec.worlds if w != spec.nproc]
        return f"{spec.nproc} ranks" + (f"; torchrun: {', '.join(map(str, spec.worlds))}" if other else "")

    listing = "\n".join(
        textwrap.fill(f"{k}: {v.what} ({ranks(v)})", width=100, initial_indent="  ", subsequent_indent="      ")
        for k, v in CASES.items()
    )
    p = subparsers.add_parser(
        "bench",
        help=COMMANDS["bench"],
        description=f"{DESCRIPTION}\n\ncases:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the case list, one a line, as written
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK_WHAT} ({QUICK_TIME})")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (default: all)")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds per case (>= 40, default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up rounds (>= 5, default 5)")
    p.add_argument("--out", default="bench-out", help="output folder (default ./bench-out)")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo (spawned local worlds, or torchrun's); cuda: NCCL under torchrun "
        "(torchrun --standalone --nproc-per-node N -m shardkit bench --device cuda ...; without "
        "torchrun: the one-rank cases on cuda:0)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the selected cases and write the outputs (rank 0); returns 0, or 1 where a case failed
    in a one-process world (elsewhere a failed check raises)."""

    if args.rounds < 40 or args.warmup < 5:
        raise SystemExit("shardkit bench: docs/design.md (Benchmarks) needs --rounds >= 40 and --warmup >= 5")
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    device = getattr(args, "device", "cpu")
    settings = Settings(rounds=args.rounds, warmup=args.warmup, quick=args.quick, device=device)
    t0 = time.perf_counter()
    skipped: list[dict] = []
    try:
        if device == "cpu" and torchrun_env() is None:
            records, writer = run_bench(names, settings, progress=not args.quiet), True
        else:
            if unknown := [n for n in names if n not in CASES]:
                raise ValueError(f"unknown bench case(s) {unknown}; choose from {list(CASES)}")
            records, skipped, writer = run_in_world(names, settings, progress=not args.quiet)
    except ValueError as exc:  # (ShardkitError included)
        text = str(exc)
        raise SystemExit(text if text.startswith("shardkit bench") else f"shardkit bench: {text}") from None
    if not writer:
        return 0  # rank 0 of a torchrun world writes the outputs

    argv = (["--quick"] if args.quick else []) + (["--cases", args.cases] if set(names) != set(CASES) else [])
    argv += [] if args.rounds == 40 else ["--rounds", str(args.rounds)]
    argv += [] if device == "cpu" else ["--device", device]
    env = dict(environment(argv, backend_name(device)), elapsed_s=round(time.perf_counter() - t0, 1))
    run_settings = dict(rounds=args.rounds, warmup=args.warmup, quick=args.quick, cases=names, device=device)
    doc = write_outputs(records, run_settings, env, args.out, skipped)
    with open(f"{args.out}/bench.md") as f:
        sys.stdout.write(f.read())
    print(
        f"\n{len(records)} records in {env['elapsed_s']:.0f} s; wrote {args.out}/bench.json, bench.md, "
        + ", ".join(p.rsplit("/", 1)[-1] for p in doc["plots"])
    )
    failed = [s["case"] for s in skipped if s.get("failed")]
    if len(skipped) > len(failed):
        print(
            f"{len(skipped) - len(failed)} case(s) skipped (not run): "
            + ", ".join(s["case"] for s in skipped if not s.get("failed"))
        )
    if failed:
        print(f"{len(failed)} case(s) FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
