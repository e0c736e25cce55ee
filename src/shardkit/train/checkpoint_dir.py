"""``--checkpoint-dir`` checked before launch (pure: a function of the file system and the
configuration), so a run never trains and then fails at its first save, nor mixes its saves
with another run's.

The directory must be absent or empty (a new run), or a shardkit checkpoint root: only saves
(``step_*``), the ``latest`` pointer and dot files. A root holding complete saves is resumed
only with ``--resume``, and only when its latest save is of this model (``--resume-from PATH``:
the save at PATH, checked alike; its run saves into a ``--checkpoint-dir`` holding no saves): the manifest of every
save written by ``shardkit train`` describes the model (:func:`model_description`), compared
here before any process starts. A root locked by a live run is refused here too (the lock
itself is taken by the run, :mod:`shardkit.checkpoint.lock`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..checkpoint.lock import LOCK, describe, holder_alive, link_lock, lock_holder
from ..checkpoint.paths import check_inside
from ..checkpoint.versioned import LATEST, MANIFEST, complete_saves, latest_checkpoint, read_manifest
from ..errors import ShardkitError
from .specs import model_spec

if TYPE_CHECKING:
    from .options import TrainConfig

__all__ = ["model_description", "check_checkpoint_dir", "recheck_checkpoint_dir", "resume_source"]

_PREFIX = "step_"  # the trainer's saves (shardkit.checkpoint.train_state)


def model_description(cfg: TrainConfig) -> dict:
    """What fixes the model's parameter names, shapes and dtype (JSON; a validated ``cfg``):
    ``model``, ``dtype`` and the model spec's description (:attr:`.specs.ModelSpec.describe`)."""
    return {"model": cfg.model, "dtype": cfg.dtype, **model_spec(cfg.model).describe(cfg)}


def _differences(saved, mine: dict) -> str:
    if not isinstance(saved, dict):
        return "its manifest does not describe the model (not written by shardkit train)"
    keys = sorted(set(saved) | set(mine))
    diff = [
        f"{k} {saved.get(k)!r} (checkpoint) vs {mine.get(k)!r} (this run)" for k in keys if saved.get(k) != mine.get(k)
    ]
    return "; ".join(diff)


def _ours(root: str, name: str) -> bool:
    """A name a checkpoint root holds: a save directory, the pointer (or its temporary file), a
    dot file (the lock)."""
    if name.startswith(".") or name == LATEST or name.startswith(f"{LATEST}.tmp-"):
        return True
    return name.startswith(_PREFIX) and os.path.isdir(os.path.join(root, name))


def check_checkpoint_dir(cfg: TrainConfig, locked: bool = False) -> str | None:
    """Refuse, before launch, a ``--checkpoint-dir`` the run could not use or would damage.

    Args:
        cfg: the validated configuration.
        locked: the run holds the directory's lock (:func:`recheck_checkpoint_dir`): its own
            lock is not "in use".

    Returns:
        With ``--resume`` or ``--resume-from``, the line to tell the user what the run continues
        from: the step, the save's path and the layout it was saved at, or (``--resume``) that no
        save was found and the run starts at step 0 (a requeued job's first start); else None.

    Raises:
        ShardkitError: naming ``--checkpoint-dir``: empty, a file, a directory holding other
            files, a save or ``latest`` that is a symbolic link resolving outside it, a ``.lock``
            that is a symbolic link, locked by a live run, holding saves without ``--resume``, or (with it) a
            latest save that is damaged, of another model, or at a step not below ``--steps``;
            naming ``--resume-from``: PATH holds no save, or one of those faults.
    """
    said = None
    if cfg.resume_from is not None:
        flag = f"--resume-from {cfg.resume_from!r}"
        said = _continued("--resume-from", flag, _save_at(cfg.resume_from), cfg)
    root = cfg.checkpoint_dir
    if root is None:
        return said
    nothing = f"--resume: no save in {root!r}: this run starts at step 0" if cfg.resume else None
    flag = f"--checkpoint-dir {root!r}"
    if not root.strip():
        raise ShardkitError(f"{flag}: give a directory")
    if os.path.exists(root) and not os.path.isdir(root):
        raise ShardkitError(f"{flag}: exists and is not a directory")
    if not os.path.isdir(root):
        return nothing or said  # created by the first save
    names = os.listdir(root)
    foreign = sorted(n for n in names if not _ours(root, n))
    if foreign:
        raise ShardkitError(
            f"{flag} holds files that are not shardkit train saves ({', '.join(foreign[:3])}); "
            "saves would mix with them: choose an empty or new directory"
        )
    for name in names:  # a link out of the root: never loaded, written through or removed by --keep
        if name.startswith(_PREFIX) or name == LATEST:
            try:
                check_inside(root, os.path.join(root, name), "save" if name != LATEST else "pointer")
            except ShardkitError as exc:
                raise ShardkitError(f"{flag}: {exc}") from None
    if os.path.islink(os.path.join(root, LOCK)):
        raise ShardkitError(f"{flag}: {link_lock(os.path.join(root, LOCK))}")
    holder = None if locked else lock_holder(root)
    if holder is not None and holder_alive(holder):
        raise ShardkitError(
            f"{flag} is in use by {describe(holder)}; wait for it to end or choose another "
            f"directory (remove {os.path.join(root, '.lock')} if no such run exists)"
        )
    saves = complete_saves(root, _PREFIX)
    if not saves:
        return nothing or said
    if not cfg.resume:  # --resume-from too: its run saves a new lineage, never among another's saves
        raise ShardkitError(
            f"{flag} holds the saves of an earlier run ({saves[-1]}, {len(saves)} in all); pass "
            "--resume to continue it or choose another directory"
        )
    try:
        latest = latest_checkpoint(root)
        if latest is None:
            raise ShardkitError(f"it holds saves but no '{LATEST}' pointer (damaged)")
    except ShardkitError as exc:  # a pointer outside the root, a missing save
        raise ShardkitError(f"{flag}: cannot resume: {exc}") from None
    return _continued("--resume", flag, latest, cfg)


def recheck_checkpoint_dir(cfg: TrainConfig, root: str) -> None:
    """:func:`check_checkpoint_dir` again, by rank 0 once the run holds the lock of ``root``
    (``cfg.checkpoint_dir``): between the check before launch and the lock, a link may have been
    planted, or another run may have saved there."""
    del root  # cfg.checkpoint_dir, made absolute by the lock
    check_checkpoint_dir(cfg, locked=True)


def resume_source(cfg: TrainConfig) -> str | None:
    """The save a run continues from (pure): ``--resume-from``'s, or with ``--resume`` the latest
    complete save in ``--checkpoint-dir``; None for a run from step 0.

    Raises:
        ShardkitError: ``--resume-from PATH`` holds no save (neither a checkpoint root with a
            ``latest`` pointer nor one save's directory with its manifest), or its pointer is damaged.
    """
    if cfg.resume_from is not None:
        return _save_at(cfg.resume_from)
    if cfg.resume and cfg.checkpoint_dir is not None and os.path.isdir(cfg.checkpoint_dir):
        return latest_checkpoint(cfg.checkpoint_dir)
    return None


def _save_at(path: str) -> str:
    """The save ``--resume-from PATH`` names: a checkpoint root's latest, or PATH itself if it is one save."""
    flag = f"--resume-from {path!r}"
    try:
        found = latest_checkpoint(path) if os.path.isdir(path) else None
    except ShardkitError as exc:
        raise ShardkitError(f"{flag}: {exc}") from None
    if found is not None:
        return found
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    what = "does not exist" if not os.path.exists(path) else "holds no save"
    raise ShardkitError(
        f"{flag} {what}: expected a checkpoint directory (with a '{LATEST}' pointer) or one save's "
        f"directory (with {MANIFEST}) written by shardkit train --checkpoint-dir"
    )


def _continued(how: str, flag: str, latest: str, cfg: TrainConfig) -> str:
    """The line saying what the run continues from, after checking that the save at ``latest``
    is of this model and below ``--steps``."""
    try:
        manifest = read_manifest(latest)
    except ShardkitError as exc:  # a missing save, a garbage manifest
        raise ShardkitError(f"{flag}: cannot resume: {exc}") from None
    saved = manifest.get("model")
    # A save of an earlier shardkit describes no model: the load's own check of every key's shape
    # and dtype (checkpoint/contents.py) still refuses another model, on every rank.
    differences = "" if saved is None else _differences(saved, model_description(cfg))
    if differences:
        raise ShardkitError(f"{flag}: {how} from {os.path.basename(latest)}, a save of another model: {differences}")
    step = manifest.get("step")
    if isinstance(step, int) and cfg.steps <= step:
        raise ShardkitError(
            f"--steps {cfg.steps}: the save to resume ({latest}) is at step {step} already, so there is "
            f"nothing to train; --steps counts all the steps, so pass more than {step}"
        )
    layout = manifest.get("layout") or "an unrecorded layout"
    return f"{how}: continuing from step {step} of {latest} (saved at {layout})"
