"""The measuring method of ``shardkit bench`` (docs/design.md (Benchmarks)), shared by every case.

Absolute times on shared machines swing by tens of percent between runs; paired ratios taken in
the same rounds do not. So every case times its variants in one loop: each round runs every
variant once, in alternating order, with a barrier before each op; the per-op time is the
maximum over the ranks; a case reports the median of per-round ratios with their spread.

Nothing here prints; :mod:`.report` summarizes and renders what the cases return.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm._group import group_device, resolve_group
from ..comm.agree import agree as agree_over
from ._timing import Timer, bench_device

__all__ = ["Settings", "Record", "time_interleaved", "agree", "quantiles", "same_bits", "close", "SPREAD"]

# (quantile, name) pairs every summary reports: the median and two spreads.
SPREAD = ((0.1, "p10"), (0.25, "q1"), (0.5, "median"), (0.75, "q3"), (0.9, "p90"))


@dataclass(frozen=True)
class Settings:
    """What every case is run with; picklable (it crosses into the spawned ranks). ``device``:
    ``"cpu"`` or ``"cuda"`` (this rank's current GPU), where every case allocates its tensors."""

    rounds: int = 40
    warmup: int = 5
    quick: bool = False
    device: str = "cpu"

    @property
    def torch_device(self) -> torch.device:
        return bench_device(self)


@dataclass
class Record:
    """What one case measured: per-variant per-round times and derived per-round ratios.

    ``ratios`` maps a name (``"shardkit/bare"``) to ``(per-round values, goal or None)``; a goal
    is an upper bound on the median. ``busbw`` maps a variant to ``(bytes per rank, nccl-tests
    factor)``, for bus bandwidth = bytes / time * factor. ``params`` describes the case (sizes,
    shapes) in JSON-able values; ``checked`` says what was verified before timing.
    """

    case: str
    params: dict
    nproc: int
    times_s: dict[str, list[float]]
    ratios: dict[str, tuple[list[float], float | None]] = field(default_factory=dict)
    busbw: dict[str, tuple[int, float]] = field(default_factory=dict)
    checked: str = ""

    def ratio(self, name: str, num: str, den: str, goal: float | None = None, scale: float = 1.0) -> Record:
        """Add the per-round ratio ``scale * times[num] / times[den]``; returns self."""
        self.ratios[name] = ([scale * a / b for a, b in zip(self.times_s[num], self.times_s[den])], goal)
        return self

    def to_json(self) -> dict:
        return dict(
            case=self.case,
            params=self.params,
            nproc=self.nproc,
            times_s=self.times_s,
            ratios={k: dict(values=v, goal=g) for k, (v, g) in self.ratios.items()},
            busbw={k: dict(bytes=b, factor=f) for k, (b, f) in self.busbw.items()},
            checked=self.checked,
        )


def time_interleaved(
    fns: dict, pg, settings: Settings, reps: int = 1, timer: Timer | None = None
) -> dict[str, list[float]]:
    """Seconds per call of each variant and round, max over the ranks of ``pg``.

    Every round runs each variant once (``reps`` calls in a row, reported per call), in
    alternating order so that neither side always follows the other, after a barrier; the first
    ``settings.warmup`` rounds are not recorded. ``timer``: default a :class:`~._timing.Timer`
    on ``settings``' device (CUDA events around each op there).
    """
    timer = Timer(settings.torch_device) if timer is None else timer
    names = list(fns)
    times = torch.zeros(settings.rounds, len(names), dtype=torch.float64)
    for i in range(settings.warmup + settings.rounds):
        for j in range(len(names)) if i % 2 == 0 else reversed(range(len(names))):
            dist.barrier(group=pg)
            seconds = timer.time(fns[names[j]], reps)
            if i >= settings.warmup:
                times[i - settings.warmup, j] = seconds
    times = times.to(group_device(resolve_group(pg, "bench")))  # NCCL reduces device tensors only
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=pg)  # per-op time = the slowest rank
    return {name: times[:, j].tolist() for j, name in enumerate(names)}


def agree(failures: list[str], pg, what: str) -> None:
    """Raise the same AssertionError on every rank if any rank found a failure (naming the
    ranks and their failures), so a correctness check that fails on one rank does not leave the
    others timing alone. One small all-reduce when every rank passed
    (:func:`~shardkit.comm.agree.agree`)."""
    failed = "; ".join(failures) if failures else None
    agree_over(resolve_group(pg, what), what, failed, headline="{n} of {size} ranks failed", error_type=AssertionError)


def quantiles(values, which=SPREAD) -> dict[str, float]:
    """``{name: quantile}`` of ``values`` for ``which = ((q, name), ...)``."""
    q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor([w for w, _ in which], dtype=torch.float64))
    return dict(zip((n for _, n in which), q.tolist()))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` would accept ``-0.0 == 0.0``)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-4) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)
