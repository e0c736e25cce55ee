"""Per-step metrics of ``shardkit train --report DIR``: ``metrics.jsonl`` always, TensorBoard
scalars in ``DIR/tb/`` when the ``tb`` extra (``tensorboard``) is installed, and a Weights &
Biases run with ``--wandb PROJECT`` (with or without ``--report``; :mod:`.loggers`).

All are written by rank 0 as training goes (one line / one event per step, flushed), so a run
can be followed live (``tail -f DIR/metrics.jsonl``, ``tensorboard --logdir DIR/tb``) and a
crashed run keeps every step it finished.

Every line carries the ``run_id`` of its run. A new run (from step 0) into a folder holding an
earlier run's files starts afresh: ``metrics.jsonl``, ``tb/``, ``report.json`` and ``loss.png``
of that run move to ``DIR/runs/<its run_id>/`` first. A resumed run (``--resume`` finding a save,
or ``--resume-from``) appends to the folder's ``metrics.jsonl`` and ``tb/`` under the run id of
the file's last line: one id per lineage of saves (a new id if the folder holds no metrics).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import secrets
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from .._files import finite_json
from .._optional import missing
from ..comm.ledger import CommLedger
from ..errors import ShardkitError
from ..plan.model import ModelShape
from ..plan.peaks import gpu_peak
from ..sharding import AXES, FLAT_VIEWS, ParallelMesh
from .loggers import Logger, TensorBoardLogger, WandbLogger, scalars
from .trainer import StepStats

if TYPE_CHECKING:
    from .options import TrainConfig

__all__ = [
    "MetricsLog",
    "open_metrics",
    "ledger_rows",
    "peak_memory",
    "TB_DIR",
    "RUNS_DIR",
    "RUN_FILES",
    "new_run_id",
    "last_run_id",
    "model_size",
    "peak_flops",
    "utilisation",
]

TB_DIR = "tb"
"""Sub-folder of the report folder that holds the TensorBoard event files."""
RUNS_DIR = "runs"
"""Sub-folder of the report folder that keeps earlier runs' files, one folder per run id."""
RUN_FILES = ("metrics.jsonl", TB_DIR, "report.json", "loss.png")
"""The files of one run in the report folder, moved aside when a new run starts there."""


def model_size(model: torch.nn.Module, seq_len: int) -> dict[str, Any]:
    """``parameters`` (every one, shared ones once) and ``flops_per_token`` of a whole, unsharded
    model: the planner's training FLOPs per token (:meth:`shardkit.plan.model.ModelShape.
    flops_per_token`, ``6 N`` plus causal attention) for a Hugging Face decoder of a family it
    knows, else None (e.g. the conv autoencoder)."""
    flops = None
    config = getattr(model, "config", None)
    if config is not None:
        try:
            flops = ModelShape.from_config(config).flops_per_token(seq_len)
        except ShardkitError:  # a family the planner does not describe: no MFU, said as n/a
            flops = None
    return {"parameters": sum(p.numel() for p in model.parameters()), "flops_per_token": flops}


def peak_flops(device: torch.device, dtype: str = "bf16") -> tuple[float | None, str]:
    """The dense ``dtype`` peak FLOP/s of one ``device`` (:func:`shardkit.plan.peaks.gpu_peak`:
    H100, H800, H200, GH200, B200, GB200, A100, MI300X, with datasheet sources), and what it is;
    ``(None, why)`` on a CPU, a GPU without a figure or a dtype it has no peak for (the summary's
    MFU is then "n/a").

    Args:
        device: this rank's device; ROCm's torch reports an AMD GPU as ``cuda`` too.
        dtype: ``"bf16"`` (the trainer's compute), ``"fp16"`` or ``"fp8"``.
    """
    if device.type != "cuda":
        return None, f"n/a on {device.type} (no peak figure)"
    name = torch.cuda.get_device_name(device)
    row = gpu_peak(name)
    tflops = row.tflops(dtype) if row is not None else None
    if row is None or tflops is None:
        return None, f"n/a (no {dtype} peak figure for {name})"
    return tflops * 1e12, f"of the {row.label} dense {dtype} peak, {tflops:g} TFLOP/s per GPU"


def utilisation(
    flops_per_token: float | None, tokens_per_s: float | None, nproc: int, device: torch.device
) -> dict[str, Any]:
    """``mfu``: model FLOPs utilisation, ``flops_per_token x tokens/s / (nproc x peak)``
    (:func:`peak_flops`, bf16), or None (a CPU, a GPU without a peak figure, a model without a FLOPs
    count, a rate not in tokens); ``mfu_basis``: against what, or why not."""
    peak, basis = peak_flops(device)
    if peak is None or flops_per_token is None or tokens_per_s is None:
        return {"mfu": None, "mfu_basis": basis if peak is None else "n/a (no FLOPs count for this model)"}
    return {"mfu": flops_per_token * tokens_per_s / (nproc * peak), "mfu_basis": basis}


def new_run_id() -> str:
    """A fresh run id: the UTC start time and 4 random hex digits (``20261126T040411Z-3f2a``)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(2)


def last_run_id(path: str) -> str | None:
    """The ``run_id`` of the last line of the metrics file ``path`` (None: no file, no id)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))  # a line is far shorter
            lines = f.read().splitlines()
    except OSError:
        return None
    try:
        found = json.loads(lines[-1]).get("run_id") if lines else None
    except (ValueError, AttributeError):  # a torn last line (a killed run), not an object
        return None
    return found if isinstance(found, str) else None


def _archive(folder: str) -> str | None:
    """Move an earlier run's files (:data:`RUN_FILES`) to ``folder/runs/<its run id>``; the folder used."""
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(folder, n))]
    if not present:
        return None
    metrics = os.path.join(folder, RUN_FILES[0])
    when = os.path.getmtime(os.path.join(folder, present[0]))
    old = last_run_id(metrics) or time.strftime("unnamed-%Y%m%dT%H%M%SZ", time.gmtime(when))
    target = os.path.join(folder, RUNS_DIR, old)
    n = 1
    while os.path.exists(target):  # never mix two runs' files
        n += 1
        target = os.path.join(folder, RUNS_DIR, f"{old}.{n}")
    os.makedirs(target)
    for name in present:
        os.replace(os.path.join(folder, name), os.path.join(target, name))
    return target


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank in bytes: CUDA allocator peak, or the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class MetricsLog:
    """One JSON line per step in ``DIR/metrics.jsonl``, and the same scalars to every
    :class:`~shardkit.train.loggers.Logger`: TensorBoard in ``DIR/tb``, Weights & Biases.

    Fields: ``step`` (1-based), ``loss``, ``grad_norm`` (before clipping), ``lr``,
    ``tokens_per_s`` (or ``pixels_per_s``), ``step_time_s``, ``peak_memory_bytes`` (this rank),
    ``skipped`` (the loss or norm was not finite: the step was not applied; a non-finite value is
    written as ``null`` and its field named in ``nonfinite``, as JSON has no NaN), and on the run's
    first step ``saved_activation_bytes``: the bytes rank 0's decoder blocks kept for backward
    (:class:`~shardkit.parallelize.saved_bytes.SavedBytesMeter`; on CPU the activation measure,
    the peak being the process's max RSS); ``eval_loss`` on the steps validated
    (``--eval-every``; TensorBoard ``eval/loss``). With ``--moe-*`` flags the fields of
    :meth:`~shardkit.train.moe_balance.MoEBalance.after_step` but ``moe_load_counts``.
    ``run_id``: see the module's note (a new run moves an earlier run's files aside; a resumed one
    appends under its lineage's id). The loggers get the same scalars (memory in MiB) under
    ``train/<field>`` (``eval/loss``) with the step as the global step (:func:`.loggers.scalars`).

    Args:
        folder: the report folder (created if needed); None: no ``metrics.jsonl`` and no
            TensorBoard, only ``wandb_project``'s run.
        unit: ``"tokens"`` or ``"pixels"``: the throughput field is ``<unit>_per_s``.
        sample_size: tokens (or pixels) of one sample; times ``batch_size``: one step's work.
        batch_size: samples per global batch.
        device: this rank's device (its peak memory is recorded).
        tensorboard: write TensorBoard scalars; None: when ``tensorboard`` is installed.
        resumed: the run continues a save (append under the folder's last run id).
        wandb_project: log to this Weights & Biases project too (:class:`~shardkit.train.loggers.
            WandbLogger`, offline unless ``WANDB_MODE`` says otherwise), run id = ``run_id``.
        config: the run's options, for the W&B run's config.

    Attributes:
        run_id: this run's id; ``archived``: where an earlier run's files were moved (or None);
        ``loggers``: the backends written to, TensorBoard first.
    """

    def __init__(
        self,
        folder: str | None,
        unit: str,
        sample_size: int,
        batch_size: int,
        device: torch.device,
        tensorboard: bool | None = None,
        resumed: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
    ) -> None:
        self.path: str | None = None
        self.archived = None
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
            self.path = os.path.join(folder, RUN_FILES[0])
            self.archived = None if resumed else _archive(folder)
        self.run_id = (last_run_id(self.path) if resumed and self.path else None) or new_run_id()
        self.unit, self.per_step, self.device = unit, sample_size * batch_size, device
        if tensorboard is None:
            tensorboard = not missing(["tensorboard"])
        self.tb_dir: str | None = os.path.join(folder, TB_DIR) if tensorboard and folder is not None else None
        self.loggers: list[Logger] = []
        self.wandb_dir: str | None = None
        try:
            if self.tb_dir is not None:
                self.loggers.append(TensorBoardLogger(self.tb_dir))
            if wandb_project is not None:
                wandb = WandbLogger(wandb_project, self.run_id, folder, config)
                self.loggers.append(wandb)
                self.wandb_dir = wandb.run_dir
        except BaseException:
            self.close()  # the loggers opened before the failure
            raise

    def write(
        self, step: int, stats: StepStats, lr: float, saved_bytes: int | None = None, eval_loss: float | None = None
    ) -> dict[str, Any]:
        """Record 0-based ``step`` (``saved_bytes``: its measured activation bytes, if counted;
        ``eval_loss``: the held-out loss after it, if evaluated); returns the line."""
        line: dict[str, Any] = {
            "run_id": self.run_id,
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
        if eval_loss is not None:
            line["eval_loss"] = eval_loss
        line.update({k: v for k, v in (stats.moe or {}).items() if k != "moe_load_counts"})  # --moe-* flags
        written, nonfinite = finite_json(line)  # NaN / inf are no JSON: null, named in "nonfinite"
        if nonfinite:
            written["nonfinite"] = nonfinite
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(written, allow_nan=False) + "\n")
        tagged = scalars(line)
        for logger in self.loggers:
            logger.log(step + 1, tagged)
        return written

    def files(self) -> list[str]:
        """What this log wrote: ``metrics.jsonl``, the TensorBoard folder, the W&B run's folder."""
        return [p for p in (self.path, self.tb_dir, self.wandb_dir) if p is not None]

    def close(self) -> None:
        """Close every logger (the JSONL file is closed after every line)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()


def open_metrics(
    cfg: TrainConfig, rank: int, unit: str, sample_size: int, device: torch.device, resumed: bool
) -> MetricsLog | None:
    """The trainer's :class:`MetricsLog` on global rank 0 when ``--report`` or ``--wandb`` asks
    for one (None elsewhere): ``cfg.report``'s files, ``cfg.wandb``'s run with the options as
    its config."""
    if rank != 0 or (cfg.report is None and cfg.wandb is None):
        return None
    return MetricsLog(
        cfg.report, unit, sample_size, cfg.batch_size, device, resumed=resumed, wandb_project=cfg.wandb,
        config=dataclasses.asdict(cfg),
    )  # fmt: skip


def ledger_rows(ledger: CommLedger, mesh: ParallelMesh) -> list[dict]:
    """Ledger totals by (mesh axis, op, issuing api, phase, group size, dtype), axes in mesh order
    (dtype ``"-"`` where the call did not say: metadata checks)."""
    rows: dict[tuple, dict] = {}
    for r in ledger.records:
        key = (mesh.axis_of(r.group_name), r.op, r.api, r.phase, r.group_size, r.dtype or "-")
        row = rows.setdefault(key, dict(count=0, bytes_sent=0, bytes_received=0))
        row["count"] += 1
        row["bytes_sent"] += r.bytes_sent
        row["bytes_received"] += r.bytes_received
    keys = ("axis", "op", "api", "phase", "group_size", "dtype")
    order = {name: i for i, name in enumerate((*AXES, "ep", "edp", *FLAT_VIEWS, "world"))}
    ranked = sorted(rows.items(), key=lambda item: (order.get(item[0][0].split("=")[0], len(order)), item[0]))
    return [{**dict(zip(keys, key)), **row} for key, row in ranked]
