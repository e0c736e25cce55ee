"""The trainer's saves, said in the run's output: which step was saved where, which older save
``--keep`` removed, and after an interrupted run the save to resume from (issue 32, item 6).

A save is collective (:func:`~shardkit.checkpoint.save_train_state`); only the rank that prints
the progress (rank 0) lists the saves around it and says what changed, so the lines are printed
once and never wait for another rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..checkpoint import save_train_state
from ..checkpoint.versioned import complete_saves, latest_checkpoint, read_manifest
from ..errors import ShardkitError
from .checkpoint_dir import model_description
from .options import TrainConfig

__all__ = ["save_step", "last_save_note"]

_PREFIX = "step_"  # the trainer's saves (shardkit.checkpoint.train_state)


def save_step(
    cfg: TrainConfig, pm, optimizer, done: int, extra: dict, layout: str, hf, say: Callable[[str], None] | None
) -> str:
    """Save the training state after ``done`` steps into ``cfg.checkpoint_dir`` (the newest
    ``cfg.keep`` saves kept); return the save's directory.

    ``say``: rank 0's line printer (the progress's :meth:`note`), None on the other ranks:
    ``saved step N: PATH``, then ``removed PATH (--keep K)`` for each save the retention deleted.
    """
    root = cfg.checkpoint_dir
    assert root is not None  # the caller saves only with --checkpoint-dir
    before = set(complete_saves(root, _PREFIX)) if say is not None and os.path.isdir(root) else set()
    path = save_train_state(
        root, pm, optimizer, done, extra, layout, keep=cfg.keep, model=model_description(cfg), hf=hf
    )
    if say is not None:
        say(f"saved step {done}: {path}")
        for name in sorted(before - set(complete_saves(root, _PREFIX))):
            say(f"removed {os.path.join(root, name)} (--keep {cfg.keep})")
    return path


def last_save_note(cfg: TrainConfig) -> str:
    """What an interrupted run (Ctrl-C, SIGTERM) leaves to continue from, for the launcher to print.

    ``last save: step N (PATH); rerun with --resume to continue from it`` when
    ``--checkpoint-dir`` holds a complete save; otherwise what there is (no directory, no save yet).
    """
    root = cfg.checkpoint_dir
    if root is None:
        return "no checkpoint: without --checkpoint-dir DIR an interrupted run starts again from step 0"
    try:
        latest = latest_checkpoint(root) if os.path.isdir(root) else None
        step = read_manifest(latest).get("step") if latest is not None else None
    except ShardkitError as exc:  # a damaged pointer or manifest: say so rather than guess
        return f"no usable save in {root}: {exc}"
    if latest is None:
        return f"no save in {root} yet: a rerun starts from step 0"
    again = "" if cfg.resume else " with --resume"
    return f"last save: step {step} ({latest}); rerun the same command{again} to continue from it"
