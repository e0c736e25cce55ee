"""``shardkit bench``: paired, interleaved benchmarks of every axis against its peers (docs/design.md, Benchmarks).

One method (:mod:`._method`): variants of a case timed in the same rounds, alternating order, a
barrier before each op, per-op time = max over ranks, >= 40 rounds after >= 5 warm-up, the median
of per-round ratios with its spread; every case checks its results before timing. One output
(:mod:`.report`): ``bench.json``, ``bench.md`` and PNG plots. The cases are listed in
:data:`.registry.CASES`; :func:`run_bench` runs a selection on local gloo worlds,
:func:`run_in_world` in the world torchrun made (NCCL on GPUs: ``--device cuda``), timing every
region through one :class:`~._timing.Timer` (CUDA events there).
"""

from __future__ import annotations

from ._launch import run_cases
from ._method import Record, Settings
from ._timing import Timer
from ._world import LAUNCH, run_in_world, torchrun_env
from .registry import CASES
from .report import write_outputs

__all__ = [
    "CASES",
    "LAUNCH",
    "Record",
    "Settings",
    "Timer",
    "run_bench",
    "run_in_world",
    "torchrun_env",
    "write_outputs",
]


def run_bench(names, settings: Settings, progress: bool = True) -> list[dict]:
    """Run the cases ``names`` (keys of :data:`CASES`), one spawned gloo world per world size;
    returns their records (JSON-able dicts). A failed correctness check raises."""

    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown bench case(s) {unknown}; choose from {list(CASES)}")
    return run_cases(list(names), settings, progress)
