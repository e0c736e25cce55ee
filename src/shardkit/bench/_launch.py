"""Spawn local gloo worlds and run the selected cases on them (rank 0's records come back).

One world per world size for the whole run (start-up costs seconds on 2 cores), FileStore
rendezvous (no ports), one intra-op thread per rank (the ranks share the cores; oversubscribed
pools would time scheduler noise), shardkit's opt-in metadata checks off (not part of what is
measured).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .._local_world import init_local_world, private_temp
from ._method import Settings
from .registry import CASES

__all__ = ["run_world", "run_cases"]


def _rank_entry(rank: int, nproc: int, names: list[str], settings: Settings, tmp: str, progress: bool) -> None:
    from ..comm import checks

    torch.set_num_threads(1)
    init_local_world(tmp, timedelta(seconds=300), rank, nproc)  # a FileStore in the private folder, gloo on loopback
    try:
        checks(False)
        records = []
        for name in names:
            spec = CASES[name]
            t0 = time.perf_counter()
            fn = getattr(importlib.import_module(spec.module, __package__), spec.function)
            torch.manual_seed(0)
            out = fn(dist.group.WORLD, settings)
            records += [dict(r.to_json(), suite=name) for r in out]
            if progress and rank == 0:
                print(f"  [{nproc} ranks] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(records, f)
    finally:
        dist.destroy_process_group()


def run_world(nproc: int, names: list[str], settings: Settings, progress: bool = True) -> list[dict]:
    """Run ``names`` (in order) on ``nproc`` spawned gloo ranks; rank 0's records as JSON dicts.

    A failing case (a correctness check included) raises in the parent
    (``torch.multiprocessing.ProcessRaisedException``).
    """
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as tmp, private_temp(tmp):
        # (mode 0700; torch.multiprocessing's error-file pickles go inside it too, not in /tmp)
        torch.multiprocessing.start_processes(_rank_entry, args=(nproc, names, settings, tmp, progress),
                                              nprocs=nproc, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            return json.load(f)


def run_cases(names: list[str], settings: Settings, progress: bool = True) -> list[dict]:
    """Every case of ``names`` on its world size, one spawned world per size; records in order."""
    by_world: dict[int, list[str]] = {}
    for name in names:
        by_world.setdefault(CASES[name].nproc, []).append(name)
    records = []
    for nproc, group in sorted(by_world.items()):
        records += run_world(nproc, group, settings, progress)
    order = {n: i for i, n in enumerate(names)}
    return sorted(records, key=lambda r: order[r["suite"]])  # stable: case order kept
