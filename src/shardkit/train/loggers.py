"""Where the trainer's per-step scalars go besides ``metrics.jsonl``: one small interface,
:class:`Logger`, and its backends, TensorBoard (``--report DIR``: ``DIR/tb``) and Weights &
Biases (``--wandb PROJECT``).

:class:`~shardkit.train.metrics.MetricsLog` is the only caller: it builds one line per step,
names each scalar once (``train/loss``, ``train/tokens_per_s``, ``eval/loss``, memory in MiB)
and hands the same ``{tag: value}`` to every logger, so the backends cannot drift apart and a
new one is a class with two methods. Only global rank 0 logs (the others hold no logger).

Weights & Biases runs offline unless the user chose otherwise: the training machines of this
project (and many clusters' compute nodes) have no route to the service, and an online
``wandb.init`` there waits on the network before failing. ``WANDB_MODE`` set by the user wins
(``online`` to stream, ``disabled`` to drop); an offline run is uploaded later with ``wandb sync
DIR``, the folder the run prints and lists among the report's files. Both optional packages are
checked before any process starts (:func:`check_loggers`), so a missing one is one line naming
the extra, on no rank at all, instead of a failure on rank 0 alone.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

from .._optional import require
from ..errors import ShardkitError

__all__ = ["Logger", "TensorBoardLogger", "WandbLogger", "check_loggers", "scalars", "wandb_mode"]

# Characters the W&B service refuses in a project name (its own check fails late, at init).
_BAD_PROJECT_CHARS = set("/\\#?%:")


class Logger(Protocol):
    """A sink of per-step scalars.

    ``log(step, scalars)``: ``step`` is the 1-based optimizer step (the x axis of every
    backend); ``scalars`` maps a tag (``train/loss``) to a finite or non-finite float.
    ``close()``: flush and release; called once, also after a failed run.
    """

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """TensorBoard event files in ``folder`` (``torch.utils.tensorboard``, the ``tb`` extra),
    flushed after every step so ``tensorboard --logdir`` follows a live run."""

    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # torch's, imported only when TensorBoard is on

        self.folder = folder
        self._writer: Any = SummaryWriter(log_dir=folder)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def wandb_mode() -> str:
    """The W&B mode a run uses: the user's ``WANDB_MODE``, else ``"offline"`` (see the module note)."""
    return os.environ.get("WANDB_MODE") or "offline"


class WandbLogger:
    """One Weights & Biases run (the ``wandb`` extra) holding the trainer's scalars.

    Args:
        project: the W&B project (``--wandb PROJECT``).
        run_id: the trainer's run id (:func:`~shardkit.train.metrics.new_run_id`); a resumed
            run appends to the W&B run of the same id (``resume="allow"``).
        folder: where W&B writes its ``wandb/`` folder (the ``--report`` folder), or None for
            W&B's default (``./wandb``, or ``WANDB_DIR``).
        config: the run's options, shown as the W&B run's config.

    Attributes:
        run_dir: the W&B run's own folder (``.../wandb/offline-run-<time>-<id>``): what
            ``wandb sync`` uploads.

    Raises:
        MissingExtraError: ``wandb`` is not installed (``pip install 'shardkit[wandb]'``).
    """

    def __init__(self, project: str, run_id: str, folder: str | None = None, config: dict | None = None) -> None:
        require(["wandb"], "shardkit train --wandb")
        wandb = importlib.import_module("wandb")  # optional; import_module keeps mypy off its stubs
        self._run: Any = wandb.init(
            project=project,
            id=run_id,
            name=run_id,
            dir=folder,
            config=config,
            mode=wandb_mode(),
            resume="allow",
            # console="off": W&B would otherwise wrap this process's stdout and stderr to upload
            # them, which changes what the progress bar sees as a terminal.
            settings=wandb.Settings(console="off"),
        )
        self.run_dir: str | None = os.path.dirname(self._run.dir) if getattr(self._run, "dir", None) else None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """The loggers' scalars of one metrics line: ``train/<field>`` (``eval/loss``), memory in
    MiB (``train/peak_memory_mib``), ``skipped`` as 0/1, without ``step`` and ``run_id``; a list
    of numbers as ``train/<field>/<i>`` (``moe_load_max_over_mean`` per MoE layer), other lists
    (``moe_load``, ``moe_layers``) only in ``metrics.jsonl``."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if isinstance(value, list):
            if key != "moe_layers" and all(isinstance(v, (int, float)) for v in value):
                out.update({f"train/{key}/{i}": v for i, v in enumerate(value)})
            continue
        if key in ("peak_memory_bytes", "saved_activation_bytes"):
            key, value = key.replace("_bytes", "_mib"), value / 2**20
        if key == "skipped":
            value = int(value)
        if key not in ("step", "run_id"):
            out["eval/loss" if key == "eval_loss" else f"train/{key}"] = value
    return out


def check_loggers(wandb_project: str | None) -> None:
    """Before any process starts (no torch, no import of ``wandb``): ``--wandb``'s project name
    and its package.

    Raises:
        ShardkitError: an empty project name or one with a character W&B refuses.
        MissingExtraError: ``--wandb`` without the ``wandb`` package, naming
            ``pip install 'shardkit[wandb]'``.
    """
    if wandb_project is None:
        return
    bad = sorted(_BAD_PROJECT_CHARS & set(wandb_project))
    if not wandb_project.strip() or bad:
        raise ShardkitError(
            f"--wandb: {wandb_project!r} is not a W&B project name (give a non-empty name without "
            f"{' '.join(sorted(_BAD_PROJECT_CHARS))}{'; found ' + ' '.join(bad) if bad else ''})"
        )
    require(["wandb"], "shardkit train --wandb")
