"""One rank's torch.profiler trace and CUDA memory snapshot over the steps of ``--profile-steps``.

As torchtitan does (its ``profiling`` section): the profiler records the steps ``A..B`` and each
rank writes its own Chrome-trace JSON (``rank{R}.trace.json``: open it in Perfetto,
https://ui.perfetto.dev, or ``chrome://tracing``), every step inside a ``shardkit step N``
range; ``--memory-snapshot`` (CUDA only, refused before launch elsewhere) records the caching
allocator's history over the same steps and writes ``rank{R}.memory.pickle`` (open it in
https://pytorch.org/memory_viz). A run that fails before step ``B`` writes neither.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..comm._compat import dump_memory_snapshot, record_memory_history
from ..errors import ShardkitError
from .options import TrainConfig
from .profile_rules import profile_dir, profile_window

__all__ = ["StepProfiler", "step_profiler", "check_memory_snapshot_device"]


def check_memory_snapshot_device(cfg: TrainConfig) -> None:
    """Under torchrun, ``--memory-snapshot`` needs the CUDA ranks it records (the local launch was
    refused before ``import torch``: :func:`.profile_rules.check_profile_options`).

    Raises:
        ShardkitError: ``--memory-snapshot`` where torch sees no GPU (the ranks run gloo on CPU).
    """
    if cfg.memory_snapshot and not torch.cuda.is_available():
        raise ShardkitError(
            "--memory-snapshot records the CUDA caching allocator: it needs CUDA, and torch sees no GPU here "
            "(these ranks run on CPU with gloo; --profile-steps A:B profiles them)"
        )


class StepProfiler:
    """Profiles the 1-based steps ``window`` of this rank into ``folder``.

    Call :meth:`step` around each step (0-based, as the trainer counts); the files are written
    after the window's last step, :attr:`files` lists them.
    """

    def __init__(self, window: tuple[int, int], folder: str, trace: bool, memory: bool, rank: int) -> None:
        self.window, self.folder, self.rank = window, folder, rank
        self.trace, self.memory = trace, memory
        self.files: list[str] = []
        self._prof: torch.profiler.profile | None = None
        self._started = False

    def _start(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        if self.memory:
            record_memory_history(True)
        if self.trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()
        self._started = True

    def _finish(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            path = os.path.join(self.folder, f"rank{self.rank}.trace.json")
            self._prof.export_chrome_trace(path)
            self.files.append(path)
            self._prof = None
        if self.memory:
            path = os.path.join(self.folder, f"rank{self.rank}.memory.pickle")
            dump_memory_snapshot(path)
            record_memory_history(False)
            self.files.append(path)

    @contextmanager
    def step(self, step: int):
        """Around 0-based ``step``: starts recording at the window's first step (or the first
        step run, after a resume inside the window), names the step, writes after the last."""
        n = step + 1
        first, last = self.window
        if not first <= n <= last:
            yield
            return
        if not self._started:
            self._start()
        with torch.profiler.record_function(f"shardkit step {n}"):
            yield
        if n == last:
            self._finish()

    def result(self) -> dict:
        """The run's record of it: ``profile`` = the folder, the window and this rank's files."""
        return {"profile": {"dir": self.folder, "steps": list(self.window), "files": self.files}}


def step_profiler(cfg: TrainConfig) -> StepProfiler | None:
    """The :class:`StepProfiler` of this rank for ``cfg`` (None: nothing asked). Collective-free:
    every rank decides alike from the same configuration."""
    window, folder = profile_window(cfg), profile_dir(cfg)
    if window is None or folder is None:
        return None
    return StepProfiler(window, folder, cfg.profile_steps is not None, cfg.memory_snapshot, dist.get_rank())
