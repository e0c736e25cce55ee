"""Rank 0's progress for ``shardkit train``: a bar on a terminal, plain lines elsewhere.

On a terminal, :class:`TrainProgress` draws a bar (rich.progress) with the latest loss and the
rate. When stdout is not a terminal (nohup, SLURM, CI, a pipe) a bar would show nothing until
the run ends, so :class:`LogLines` prints one flushed line every ``--log-every`` steps instead:
the step, the mean loss of the steps since the last line, the learning rate and the rate over
those steps. :func:`setup_note` says on stderr what the run is doing before its first step
(reading the corpus, building, parallelizing, loading a save), so such logs are not blank during
set-up either.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["TrainProgress", "LogLines", "make_progress", "default_log_every", "setup_note", "format_eta"]


def default_log_every(steps: int) -> int:
    """``--log-every``'s default: every step for a run of at most 20 steps, else every 10."""
    return 1 if steps <= 20 else 10


def setup_note(what: str, t0: float, out: IO[str] | None = None) -> None:
    """Print ``shardkit train: [  1.2 s] <what>`` (seconds since ``t0``, ``time.perf_counter``) to
    ``out`` (default stderr), flushed: a set-up stage is starting."""
    stream = out if out is not None else sys.stderr
    print(f"shardkit train: [{time.perf_counter() - t0:6.1f} s] {what}", file=stream, flush=True)


def format_eta(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: a remaining time, to the second below an hour."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class TrainProgress:
    """Context manager showing a bar with the latest loss and the global tokens/s so far.

    Args:
        steps: total number of steps.
        tokens_per_step: tokens of one global batch (``B * S``), or whatever ``unit`` counts.
        unit: the rate's unit label (``"tok"``; ``"px"`` for pixels).
    """

    def __init__(self, steps: int, tokens_per_step: int, unit: str = "tok") -> None:
        self.tokens_per_step = tokens_per_step
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn(f"{{task.fields[tps]}} {unit}/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),  # the ETA, from rich's recent step rate
        )
        self.task = self.progress.add_task("train", total=steps, loss="-", tps="-")
        self.start = 0.0
        self.done = 0

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, lr: float | None = None, eval_loss: float | None = None) -> None:
        """Called after step ``step`` (0-based) with its global loss (``lr``, ``eval_loss``: unused by the bar)."""
        self.done += 1  # steps of this run (a resumed run starts at its save's step)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tps = self.tokens_per_step * self.done / elapsed
        self.progress.update(self.task, advance=1, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")

    def note(self, text: str) -> None:
        """A line above the bar (a save, a removed save)."""
        self.progress.console.print(text, highlight=False, soft_wrap=True)


class LogLines:
    """One plain, flushed line every ``every`` steps (and after the last step) for a log file.

    ``step 10/20  loss 2.4512 (mean of 10)  lr 1.00e-03  2,345 tok/s  eta 1m05s``: the loss is the
    mean of the steps since the previous line (non-finite ones, which were not applied, left out;
    "nan" if all were), the rate is over the same steps; a validation since the previous line adds
    ``held-out 2.3456 (step 10)``. The ETA is the steps left times the mean time of this run's
    steps after its first (the first one also warms up: compiling, allocating); it is left out
    until two steps have run, and after the last.

    Args:
        steps: total number of steps.
        tokens_per_step: tokens (or ``unit``) of one global batch.
        every: print after every ``every``-th step (1-based step numbers).
        unit: the rate's unit label.
        out: where to print (default stdout).
    """

    def __init__(self, steps: int, tokens_per_step: int, every: int, unit: str = "tok", out=None) -> None:
        self.steps, self.tokens_per_step, self.every, self.unit = steps, tokens_per_step, every, unit
        self.out = out
        self.window: list[float] = []
        self.since = 0.0
        self.held: tuple[int, float] | None = None
        self.count = 0  # steps of this run (a resumed run starts at its save's step)
        self.after_first = 0.0  # when this run's first step ended

    def __enter__(self) -> LogLines:
        self.since = time.perf_counter()
        return self

    def note(self, text: str) -> None:
        """A line of its own (a save, a removed save), flushed like the step lines."""
        print(text, file=self.out if self.out is not None else sys.stdout, flush=True)

    def _eta(self, done: int, now: float) -> str | None:
        if self.count < 2 or done >= self.steps:
            return None
        per_step = (now - self.after_first) / (self.count - 1)
        return format_eta(per_step * (self.steps - done))

    def __exit__(self, *exc) -> None:
        pass

    def update(self, step: int, loss: float, lr: float | None = None, eval_loss: float | None = None) -> None:
        """Called after step ``step`` (0-based) with its global loss, the rate it used and the
        held-out loss after it (``--eval-every``; None: not evaluated)."""
        self.window.append(loss)
        done, now = step + 1, time.perf_counter()
        self.count += 1
        if self.count == 1:
            self.after_first = now
        if eval_loss is not None:
            self.held = (done, eval_loss)
        if done % self.every and done != self.steps:
            return
        finite = [v for v in self.window if math.isfinite(v)]
        mean = sum(finite) / len(finite) if finite else float("nan")
        rate = self.tokens_per_step * len(self.window) / max(now - self.since, 1e-9)
        parts = [f"step {done}/{self.steps}", f"loss {mean:.4f} (mean of {len(self.window)})"]
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        parts.append(f"{rate:,.0f} {self.unit}/s")
        if self.held is not None:  # the latest validation since the previous line
            parts.append(f"held-out {self.held[1]:.4f} (step {self.held[0]})")
        if (eta := self._eta(done, now)) is not None:
            parts.append(f"eta {eta}")
        print("  ".join(parts), file=self.out if self.out is not None else sys.stdout, flush=True)
        self.window, self.since, self.held = [], now, None


def make_progress(steps: int, tokens_per_step: int, every: int, unit: str = "tok") -> TrainProgress | LogLines:
    """A bar when stdout is a terminal, else :class:`LogLines` every ``every`` steps."""
    if sys.stdout.isatty():
        return TrainProgress(steps, tokens_per_step, unit)
    return LogLines(steps, tokens_per_step, every, unit)
