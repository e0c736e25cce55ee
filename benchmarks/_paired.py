"""Shared machinery of the paired benchmarks in ``benchmarks/`` (docs/design.md, Benchmarks).

Not a benchmark itself: the ``bench_*.py`` scripts import it as a sibling module (they run as
``python benchmarks/<name>.py``, so ``sys.path[0]`` is this folder, and spawned ranks inherit
the parent's ``sys.path``).

- :func:`run_ranks` spawns R local gloo ranks (FileStore rendezvous, one intra-op thread each,
  shardkit's opt-in metadata checks off) and returns what rank 0's body returned, as JSON;
  :func:`run_and_report` adds the summary table and ``--json`` output around it;
- :func:`time_interleaved` times variants in the same rounds, order alternating, a barrier
  before each op, per-op time = max over ranks;
- :func:`quantiles` / :func:`ratio_q` / :func:`cell` summarise per-round values;
- :func:`add_timing_args` / :func:`check_rounds` / :func:`dump_json` / :func:`print_row` are
  the common command-line, output and JSON bits.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

QUARTILES = ((0.25, "q1"), (0.5, "median"), (0.75, "q3"))
DECILES = ((0.1, "p10"), (0.5, "median"), (0.9, "p90"))


def _rank_entry(rank: int, nproc: int, body, args: tuple, tmp: str, timeout_s: float) -> None:
    from shardkit.comm import checks

    # One thread per rank: the ranks share the machine's cores, and oversubscribed intra-op
    # pools would make the timings measure scheduler noise.
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), nproc)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nproc, timeout=timedelta(seconds=timeout_s))
    try:
        checks(False)  # the opt-in metadata agreement is not part of what is measured
        result = body(rank, dist.group.WORLD, *args)
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(body, nproc: int, *args, prefix: str = "shardkit-bench-", timeout_s: float = 300):
    """Run ``body(rank, pg, *args)`` on ``nproc`` spawned local gloo ranks; returns rank 0's result.

    ``body`` must be a module-level function (it is pickled by name) and rank 0's return value
    JSON-serialisable (it travels back through a file in a temporary directory). A failing rank
    raises in the parent (``torch.multiprocessing.ProcessRaisedException``).
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        torch.multiprocessing.start_processes(_rank_entry, args=(nproc, body, args, tmp, timeout_s), nprocs=nproc,
                                              start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            return json.load(f)


def run_and_report(args, body, nproc: int, summarize, render, meta: dict, *, prefix: str,
                   timeout_s: float = 300) -> int:
    """The usual ``main`` tail: run ``body`` on ``nproc`` ranks, print ``render(summarize(result), args,
    elapsed)`` and write ``{**meta, summary, raw}`` to ``args.json`` if given; returns 0."""
    t0 = time.perf_counter()
    results = run_ranks(body, nproc, args, prefix=prefix, timeout_s=timeout_s)
    rows = summarize(results)
    render(rows, args, time.perf_counter() - t0)
    dump_json(args.json, dict(**meta, summary=rows, raw=results))
    return 0


def time_interleaved(fns, pg, warmup: int, rounds: int, reps: int = 1):
    """Seconds per call of each variant and round, max over the ranks of ``pg``.

    Every round runs each variant once (``reps`` calls in a row, reported per call), in
    alternating order so neither side always follows the other, with a barrier before each op.
    ``fns``: a dict name -> callable (returns a dict name -> per-round list) or a sequence of
    callables (returns a list of per-round lists, in order).
    """
    names = list(fns) if isinstance(fns, dict) else list(range(len(fns)))
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
    if isinstance(fns, dict):
        return {name: times[:, j].tolist() for j, name in enumerate(names)}
    return times.T.tolist()


def quantiles(values, which=QUARTILES) -> dict[str, float]:
    """``{name: quantile}`` of ``values`` for ``which`` = ((q, name), ...), low to high."""
    q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor([w for w, _ in which], dtype=torch.float64))
    return dict(zip((n for _, n in which), q.tolist()))


def ratio_q(num, den, which=QUARTILES) -> dict[str, float]:
    """Quantiles of the per-round ratios ``num[i] / den[i]``."""
    return quantiles([a / b for a, b in zip(num, den)], which)


def cell(q: dict) -> str:
    """``median [low, high]`` of a :func:`quantiles` dict (its first and last entries)."""
    vals = list(q.values())
    return f"{q['median']:.3f} [{vals[0]:.3f}, {vals[-1]:.3f}]"


def print_row(*cells) -> None:
    print(" | ".join(cells))


def add_timing_args(p, rounds: int = 40, warmup: int = 5) -> None:
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--warmup", type=int, default=warmup)


def check_rounds(p, args) -> None:
    """The floor of docs/design.md (Benchmarks) on the number of rounds."""
    if args.rounds < 40 or args.warmup < 5:
        p.error("docs/design.md, Benchmarks: at least 40 rounds after at least 5 warm-up rounds")


def dump_json(path, obj) -> None:
    """Write ``obj`` to ``path`` (``--json``), if given."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
