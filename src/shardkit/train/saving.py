"""The trainer's saves, said in the run's output: which step was saved where, which older save
``--keep`` removed, and after an interrupted run the save to resume from (issue 32, item 6).

A save is collective (:func:`~shardkit.checkpoint.save_train_state`); only the rank that prints
the progress (rank 0) lists the saves around it and says what changed, so the lines are printed
once and never wait for another rank.

With ``--async-checkpoint`` (issue 33, item 5) a save returns once its state is staged to CPU
memory and is written behind the next steps (:mod:`shardkit.checkpoint.background`); its
"saved step N" line comes when it is committed, said by the next save or the end of the run,
which wait for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta

import torch.distributed as dist

from ..checkpoint import save_train_state
from ..checkpoint.background import BackgroundSaves
from ..checkpoint.versioned import complete_saves, latest_checkpoint, read_manifest
from ..errors import ShardkitError
from .checkpoint_dir import model_description
from .liveness import set_phase
from .options import TrainConfig

__all__ = ["StepSaves", "save_step", "last_save_note"]

_PREFIX = "step_"  # the trainer's saves (shardkit.checkpoint.train_state)


def save_step(
    cfg: TrainConfig,
    pm,
    optimizer,
    done: int,
    extra: dict,
    layout: str,
    hf,
    say: Callable[[str], None] | None,
    background: BackgroundSaves | None = None,
) -> str:
    """Save the training state after ``done`` steps into ``cfg.checkpoint_dir`` (the newest
    ``cfg.keep`` saves kept); return the save's directory.

    ``say``: rank 0's line printer (the progress's :meth:`note`), None on the other ranks:
    ``saved step N: PATH``, then ``removed PATH (--keep K)`` for each save the retention deleted.
    ``background``: write it behind (:class:`StepSaves` says its lines once it is committed).
    """
    root = cfg.checkpoint_dir
    assert root is not None  # the caller saves only with --checkpoint-dir
    before = _saves(root) if say is not None else set()
    path = save_train_state(
        root,
        pm,
        optimizer,
        done,
        extra,
        layout,
        keep=cfg.keep,
        model=model_description(cfg),
        hf=hf,
        background=background,
    )
    if say is not None and background is None:
        _say_saved(say, root, done, path, before, cfg.keep)
    return path


def _saves(root: str) -> set[str]:
    return set(complete_saves(root, _PREFIX)) if os.path.isdir(root) else set()


def _say_saved(say: Callable[[str], None], root: str, done: int, path: str, before: set[str], keep) -> None:
    say(f"saved step {done}: {path}")
    for name in sorted(before - _saves(root)):
        say(f"removed {os.path.join(root, name)} (--keep {keep})")


class StepSaves(AbstractContextManager):
    """The saves of one run (every rank; inside the run's lock of ``cfg.checkpoint_dir``): in
    the foreground, or with ``cfg.async_checkpoint`` behind the steps, one at a time, the
    pending one waited for by the next save and by the end of the run (a failure and Ctrl-C
    included: :class:`~shardkit.checkpoint.background.BackgroundSaves`).

    ``say``: rank 0's line printer, None elsewhere; ``timeout``: of the background group's
    collectives (``--timeout``).
    """

    def __init__(self, cfg: TrainConfig, say: Callable[[str], None] | None, timeout: timedelta) -> None:
        self.cfg, self.say = cfg, say
        self._background: BackgroundSaves | None = None
        self._said: tuple[int, set[str]] | None = None  # the pending save's step, the saves before it
        if cfg.async_checkpoint:
            assert cfg.checkpoint_dir is not None and dist.group.WORLD is not None  # validated; a mesh
            self._background = BackgroundSaves(cfg.checkpoint_dir, dist.group.WORLD, "save_train_state", timeout)

    def __enter__(self) -> StepSaves:
        if self._background is not None:
            self._background.__enter__()
        return self

    def save(self, pm, optimizer, done: int, extra: dict, layout: str, hf) -> str:
        """Save after ``done`` steps (:func:`save_step`); in the background, after the pending one."""
        self._settle()
        root = self.cfg.checkpoint_dir
        assert root is not None
        before = _saves(root) if self.say is not None else set()
        path = save_step(self.cfg, pm, optimizer, done, extra, layout, hf, self.say, self._background)
        if self._background is not None:
            self._said = (done, before)
            if self.say is not None:
                self.say(f"saving step {done} in the background: {path}")
        return path

    def _settle(self) -> None:
        """Wait for the pending background save; say it was saved."""
        if self._background is None or not self._background.pending:
            return
        set_phase("saving")  # the watchdog sees a wait for the disk, not a stalled step
        path = self._background.wait()
        said, self._said = self._said, None
        if self.say is not None and path is not None and said is not None:
            root = self.cfg.checkpoint_dir
            assert root is not None
            _say_saved(self.say, root, said[0], path, said[1], self.cfg.keep)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._background is None:
            return
        try:
            if exc_type is None:
                self._settle()
        finally:  # waits (again: a no-op after _settle) and releases the group and the lock
            self._background.__exit__(exc_type, exc, tb)


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
