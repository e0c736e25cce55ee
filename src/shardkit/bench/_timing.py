"""Where ``shardkit bench`` runs and how it reads the clock: the bench's device and the one
timer every timed region goes through.

On the CPU a region is ``time.perf_counter`` on both sides. On CUDA the host returns before the
kernels it launched have run, so a host clock alone would time the launches. There a region is
either a pair of ``torch.cuda.Event`` s recorded on the current stream (``events=True``, the
default: the time is read once the end event has completed) or the host clock read after a
``torch.cuda.synchronize()`` on each side (``events=False``: for regions that also add up host
time inside them, as the pipeline cases' sleeps do). A collective or P2P call joined with
``wait`` (every case's) makes the current stream wait for NCCL's, so the end event follows it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Timer", "bench_device"]


def bench_device(settings: Any) -> torch.device:
    """The device every tensor of a case is allocated on: the CPU, or this rank's current GPU
    (``torch.cuda.set_device(LOCAL_RANK)`` was called when the world was made)."""
    if settings.device == "cpu":
        return torch.device("cpu")
    return torch.device(settings.device, torch.cuda.current_device())


class Timer:
    """Seconds of a region on ``device``: ``timer.start()``, the work, ``timer.stop()``.

    Args:
        device: the device the timed work runs on; a CUDA device is timed on the device side.
        events: on CUDA, time with an event pair (else synchronize and read the host clock).
        cuda: the CUDA module (``torch.cuda``); tests pass a stand-in.
    """

    def __init__(self, device: torch.device | str = "cpu", events: bool = True, cuda: Any = None) -> None:
        self.device = torch.device(device)
        module: Any = cuda if cuda is not None else torch.cuda
        self.cuda: Any = module if self.device.type == "cuda" else None
        self.events = events and self.cuda is not None
        self._pair = (module.Event(enable_timing=True), module.Event(enable_timing=True)) if self.events else None
        self._t0 = 0.0

    def start(self) -> None:
        if self._pair is not None:
            self._pair[0].record()
            return
        if self.cuda is not None:
            self.cuda.synchronize(self.device)  # what was queued before is not part of the region
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start`, the device's work of the region included."""
        if self._pair is not None:
            begin, end = self._pair
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1e3  # milliseconds
        if self.cuda is not None:
            self.cuda.synchronize(self.device)
        return time.perf_counter() - self._t0

    def time(self, fn, reps: int = 1) -> float:
        """Seconds per call of ``reps`` calls of ``fn`` in a row."""
        self.start()
        for _ in range(reps):
            fn()
        return self.stop() / reps
