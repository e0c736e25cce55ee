"""Per-step metrics of ``shardkit train --report DIR``: ``metrics.jsonl`` always, TensorBoard
scalars in ``DIR/tb/`` when the ``tb`` extra (``tensorboard``) is installed.

Both are written by rank 0 as training goes (one line / one event per step, flushed), so a run
can be followed live (``tail -f DIR/metrics.jsonl``, ``tensorboard --logdir DIR/tb``) and a
crashed run keeps every step it finished.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

import torch

from .._optional import missing
from .trainer import StepStats

__all__ = ["MetricsLog", "peak_memory", "TB_DIR"]

TB_DIR = "tb"
"""Sub-folder of the report folder that holds the TensorBoard event files."""


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank in bytes: CUDA allocator peak, or the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class MetricsLog:
    """One JSON line per step in ``DIR/metrics.jsonl`` (and TensorBoard scalars in ``DIR/tb``).

    Fields: ``step`` (1-based), ``loss``, ``grad_norm`` (before clipping), ``lr``,
    ``tokens_per_s`` (or ``pixels_per_s``), ``step_time_s``, ``peak_memory_bytes`` (this rank),
    ``skipped`` (the loss or norm was not finite: the step was not applied), and on the run's
    first step ``saved_activation_bytes``: the bytes rank 0's decoder blocks kept for backward
    (:class:`~shardkit.parallelize.saved_bytes.SavedBytesMeter`; on CPU the activation measure,
    the peak being the process's max RSS).
    A resumed run appends to the file of the run it continues. TensorBoard gets the same scalars
    (memory in MiB) under ``train/<field>`` with the step as the global step.

    Args:
        folder: the report folder (created if needed).
        unit: ``"tokens"`` or ``"pixels"``: the throughput field is ``<unit>_per_s``.
        sample_size: tokens (or pixels) of one sample; times ``batch_size``: one step's work.
        batch_size: samples per global batch.
        device: this rank's device (its peak memory is recorded).
        tensorboard: write TensorBoard scalars; None: when ``tensorboard`` is installed.
    """

    def __init__(
        self,
        folder: str,
        unit: str,
        sample_size: int,
        batch_size: int,
        device: torch.device,
        tensorboard: bool | None = None,
    ) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "metrics.jsonl")
        self.unit, self.per_step, self.device = unit, sample_size * batch_size, device
        if tensorboard is None:
            tensorboard = not missing(["tensorboard"])
        self.tb_dir: str | None = os.path.join(folder, TB_DIR) if tensorboard else None
        self._writer: Any = None
        if self.tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.tb_dir)

    def write(self, step: int, stats: StepStats, lr: float, saved_bytes: int | None = None) -> dict[str, float]:
        """Record 0-based ``step`` (``saved_bytes``: its measured activation bytes, if counted); returns the line."""
        line = {
            "step": step + 1,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": lr,
            f"{self.unit}_per_s": self.per_step / stats.seconds,
            "step_time_s": stats.seconds,
            "peak_memory_bytes": peak_memory(self.device),
            "skipped": stats.skipped,
        }
        if saved_bytes is not None:
            line["saved_activation_bytes"] = saved_bytes
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if self._writer is not None:
            for key, value in line.items():
                if key in ("peak_memory_bytes", "saved_activation_bytes"):
                    key, value = key.replace("_bytes", "_mib"), value / 2**20
                if key == "skipped":
                    value = int(value)
                if key != "step":
                    self._writer.add_scalar(f"train/{key}", value, global_step=step + 1)
            self._writer.flush()
        return line

    def close(self) -> None:
        """Close the TensorBoard writer (the JSONL file is closed after every line)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
