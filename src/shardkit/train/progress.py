"""Rank 0's progress bar for ``shardkit train`` (rich.progress): step, loss, tokens/s."""

from __future__ import annotations

import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["TrainProgress"]


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
        )
        self.task = self.progress.add_task("train", total=steps, loss="-", tps="-")
        self.start = 0.0

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, loss: float) -> None:
        """Called after step ``step`` (0-based) with its global loss."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tps = self.tokens_per_step * (step + 1) / elapsed
        self.progress.update(self.task, advance=1, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
