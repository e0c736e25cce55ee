"""Rank side of the bad-input catalogue: the case registry, and running one case in one mode.

A case is a body run on every rank of an n-rank gloo world (tests/harness). The body builds its
(possibly bad) input from the rank, calls one public shardkit op and returns ``(got, want)``:
``want`` is the single-process reference of this rank's output (computed locally from the full
problem, no communication), or ``None`` when the input has no valid answer, so that any result
is a silent wrong one. :func:`run_case` turns whatever happened into a small picklable record;
the controller (:mod:`bad_input_runner`) compares the records of all ranks and classifies.

The check mode is switched per call with ``shardkit.comm.checks(mode)`` as a context manager,
so nothing leaks from one case into the next.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the ranks load this file by path; the case modules sit beside it
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardkit import ShardkitError  # noqa: E402
from shardkit.comm import checks, flight_recorder  # noqa: E402

__all__ = [
    "Case",
    "Registry",
    "follow",
    "rank",
    "world",
    "prepare",
    "run_case",
    "run_case_recorded",
    "followup",
    "CASE_MODULES",
]

CASE_MODULES = (
    "bad_input_cases_comm",
    "bad_input_cases_cp",
    "bad_input_cases_ep",
    "bad_input_cases_pp",
    "bad_input_cases_spatial",
    "bad_input_cases_transforms",
    "bad_input_cases_tp",
)


@dataclass(frozen=True)
class Case:
    """One catalogue entry.

    ``kind`` says what is wrong (``control`` for a correct input, ``uneven`` for an uneven shard
    passed without its sizes, ...); ``fingerprint``: the ranks differ in weights or inputs, not
    metadata, which only the opt-in fingerprint (not the check mode) can see.
    """

    name: str
    n: int
    op: str
    kind: str
    module: str
    body: Callable[[], tuple[Any, Any]] = field(repr=False, compare=False)
    fingerprint: bool = False


class Registry(dict):
    """name -> :class:`Case` of one case module."""

    def __init__(self, module: str, skip: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.module, self.skip = module, skip

    def add(self, name: str, n: int, op: str, kind: str, body, fingerprint: bool = False) -> None:
        """Register a case; names in ``skip`` (variants a sibling op already covers, left out to
        keep the run short) are not registered."""
        if name in self:
            raise ValueError(f"duplicate case {name}")
        if name in self.skip:
            return
        self[name] = Case(name, n, op, kind, self.module, body, fingerprint)


_FOLLOW: list[Any] = []  # groups the running case declared (identically on every rank)


def follow(group):
    """Declare ``group`` for the follow-up all-reduce (call identically on every rank); returns it."""
    _FOLLOW.append(group)
    return group


def rank() -> int:
    return dist.get_rank()


_WORLD: list[Any] = []  # a desync rerun's copy of the world group (short timeout), else empty


def world():
    """The world group (in a desync rerun, its copy with a short timeout), declared for the follow-up."""
    return follow(_WORLD[0] if _WORLD else dist.group.WORLD)


def prepare() -> None:
    """Import every case module (a fresh world does this once, before any case is timed), and
    silence this rank's stderr: aborts are expected here (gloo's ``terminate called``, then a
    faulthandler dump), and each case's outcome is reported as a record instead."""
    faulthandler.disable()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    for name in CASE_MODULES:
        importlib.import_module(name)


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return False
        if not (want.is_floating_point() or want.is_complex()):
            return bool(torch.equal(got, want))
        rtol = 1e-9 if want.dtype == torch.float64 else 1e-5
        return bool(torch.allclose(got.detach(), want.detach(), rtol=rtol, atol=rtol * 1e-3, equal_nan=True))
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(_same, got, want))
    return got == want


def run_case(module: str, name: str, check: bool) -> dict:
    """Run one case on this rank in the default (``check=False``) or check mode; the outcome record."""
    case = importlib.import_module(module).CASES[name]
    _FOLLOW.clear()
    start = time.monotonic()
    try:
        with checks(check):
            got, want = case.body()
    except Exception as exc:  # every failure is data here: the controller classifies it
        return {
            "kind": "error",
            "type": type(exc).__name__,
            "shardkit": isinstance(exc, ShardkitError),
            "msg": str(exc)[:4000],
            "elapsed": time.monotonic() - start,
        }
    return {"kind": "ok", "match": want is not None and _same(got, want), "elapsed": time.monotonic() - start}


def run_case_recorded(module: str, name: str, check: bool, directory: str, timeout: float) -> dict:
    """:func:`run_case` with :func:`world` a new group of every rank whose process-group timeout
    is ``timeout`` seconds, then this rank's flight recorder (only this case's collectives: the
    worker clears it before every task) dumped into ``directory``: the desync rerun of a hang.

    A new group rather than a world started with the short timeout: the world's start
    (rendezvous of freshly forked ranks) would be held to it too, on a loaded machine."""
    _WORLD[:] = [dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout))]
    try:
        record = run_case(module, name, check)
    finally:
        _WORLD.clear()
    flight_recorder.dump_all(directory, reason=f"{name} ({'check mode' if check else 'default'})")
    return record


def followup() -> dict:
    """All-reduce a one over the world and every group the last case declared: still usable?"""
    ok = True
    for g in [dist.group.WORLD, *_FOLLOW]:
        groups = [g] if isinstance(g, dist.ProcessGroup) else [g.get_group(d) for d in range(g.ndim)]
        for pg in groups:
            if dist.get_rank(pg) < 0:
                continue  # not a member
            t = torch.ones(1)
            dist.all_reduce(t, group=pg)
            ok = ok and t.item() == dist.get_world_size(pg)
    return {"ok": ok}
