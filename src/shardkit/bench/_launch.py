"""Spawn local gloo worlds and run the selected cases on them (rank 0's records come back).

One world per world size for the whole run (start-up costs seconds on 2 cores), FileStore
rendezvous (no ports), one intra-op thread per rank (the ranks share the cores; oversubscribed
pools would time scheduler noise), shardkit's opt-in metadata checks off (not part of what is
measured). Cases on the fake process group (:attr:`.registry.CaseSpec.fake`) share one spawned
process, which initializes a fake world per size in turn.
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
from ..comm import checks
from ._method import Settings
from ._quiet import quiet_known_warnings
from .registry import CASES

__all__ = ["run_world", "run_cases", "run_named", "run_fake"]


def run_named(names: list[str], pg, settings: Settings, progress: bool, tag: str) -> list[dict]:
    """Run the cases ``names`` in order on ``pg`` (every rank calls it); this rank's records."""
    records = []
    for name in names:
        spec = CASES[name]
        t0, cpu0 = time.perf_counter(), time.process_time()
        fn = getattr(importlib.import_module(spec.module, __package__), spec.function)
        torch.manual_seed(0)
        records += [dict(r.to_json(), suite=name) for r in fn(pg, settings)]
        if progress:
            # CPU seconds of every rank (all threads, gloo's included): on a shared machine the
            # wall time says how busy it was, this says what the case costs; both are printed.
            cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64, device=settings.torch_device)
            dist.all_reduce(cpu, group=pg)
            if dist.get_rank() == 0:
                print(f"  [{tag}] {name}: {_cost(time.perf_counter() - t0, cpu.item())}", file=sys.stderr, flush=True)
    return records


def _cost(wall: float, cpu: float) -> str:
    return f"{wall:.1f} s wall, {cpu:.1f} s CPU over the ranks"


def run_fake(names: list[str], settings: Settings, progress: bool) -> list[dict]:
    """Run the cases ``names`` on torch's fake process group, once per world size of each
    (:attr:`.registry.CaseSpec.fake`), in this process (no other process group initialized)."""
    # torch registers the "fake" backend when this (test-utility) module is imported.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    records = []
    for name in names:
        spec = CASES[name]
        fn = getattr(importlib.import_module(spec.module, __package__), spec.function)
        for world in spec.fake:
            t0, cpu0 = time.perf_counter(), time.process_time()
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            try:
                torch.manual_seed(0)
                records += [dict(r.to_json(), suite=name) for r in fn(dist.group.WORLD, settings)]
            finally:
                dist.destroy_process_group()
            if progress:
                cost = _cost(time.perf_counter() - t0, time.process_time() - cpu0)
                print(f"  [fake, {world} ranks] {name}: {cost}", file=sys.stderr, flush=True)
    return records


def _rank_entry(rank: int, nproc: int, names: list[str], settings: Settings, tmp: str, progress: bool) -> None:
    quiet_known_warnings()
    torch.set_num_threads(1)
    init_local_world(tmp, timedelta(seconds=300), rank, nproc)  # a FileStore in the private folder, gloo on loopback
    try:
        checks(False)
        records = run_named(names, dist.group.WORLD, settings, progress, f"{nproc} ranks")
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(records, f)
    finally:
        dist.destroy_process_group()


def _fake_entry(rank: int, names: list[str], settings: Settings, tmp: str, progress: bool) -> None:
    quiet_known_warnings()
    torch.set_num_threads(1)
    checks(False)
    records = run_fake(names, settings, progress)
    with open(os.path.join(tmp, "result.json"), "w") as f:
        json.dump(records, f)


def run_world(nproc: int, names: list[str], settings: Settings, progress: bool = True) -> list[dict]:
    """Run ``names`` (in order) on ``nproc`` spawned gloo ranks; rank 0's records as JSON dicts.
    ``nproc == 0``: the cases run on fake process groups in one spawned process.

    A failing case (a correctness check included) raises in the parent
    (``torch.multiprocessing.ProcessRaisedException``).
    """
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as tmp, private_temp(tmp):
        # (mode 0700; torch.multiprocessing's error-file pickles go inside it too, not in /tmp)
        if nproc == 0:  # the cases on the fake process group, in one process
            torch.multiprocessing.start_processes(
                _fake_entry, args=(names, settings, tmp, progress), nprocs=1, start_method="spawn"
            )
        else:
            torch.multiprocessing.start_processes(
                _rank_entry, args=(nproc, names, settings, tmp, progress), nprocs=nproc, start_method="spawn"
            )
        with open(os.path.join(tmp, "result.json")) as f:
            return json.load(f)


def run_cases(names: list[str], settings: Settings, progress: bool = True) -> list[dict]:
    """Every case of ``names`` on its world size, one spawned world per size; records in order."""
    by_world: dict[int, list[str]] = {}
    for name in names:
        by_world.setdefault(0 if CASES[name].fake else CASES[name].nproc, []).append(name)
    records = []
    for nproc, group in sorted(by_world.items()):
        records += run_world(nproc, group, settings, progress)
    order = {n: i for i, n in enumerate(names)}
    return sorted(records, key=lambda r: order[r["suite"]])  # stable: case order kept
