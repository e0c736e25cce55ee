"""One commit protocol for every shardkit checkpoint: a versioned directory per save, a manifest
written last, an atomic ``latest`` pointer.

Layout under a checkpoint root::

    ROOT/<prefix><NNNNNNNN>/   the data of one save (DCP files), then MANIFEST.json, written last
    ROOT/latest                the name of the newest complete save, replaced atomically

The file-system operations of a save, in order, and what a kill between any two leaves (the
caller holds the root's lock, :mod:`.lock`, so no other run does any of them meanwhile):

1. rank 0 removes stale saves (directories of this prefix without a manifest: killed saves)
   and temporary pointer files (``latest.tmp-*``: a commit killed before its ``os.replace``);
2. every rank writes its data into ``ROOT/<prefix><N>/`` (DCP; ``.metadata`` last);
3. rank 0 writes ``MANIFEST.json`` (a temporary file, fsynced, then ``os.replace``);
4. rank 0 writes ``latest`` the same way: from this ``os.replace`` on, the new save is the latest;
5. rank 0 removes saves older than the newest ``keep`` (manifest first, so a half-removed save is
   stale, never mistaken for a complete one).

Before step 4 returns, ``latest`` still names the previous complete save, whose files no step
touches; after it, the new one. A directory without a manifest is never loaded and is removed
by the next save; a complete save is never removed but by ``keep``, nor replaced. Rename of a
single file over another is atomic on POSIX file systems, unlike
renaming a directory over a non-empty one (which needs a second rename and leaves a window with
no checkpoint at all).

Source: the manifest-last / atomic-pointer commit of Megatron-LM's
``latest_checkpointed_iteration.txt`` and torchtitan's ``step-N`` directories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import TYPE_CHECKING

from ..comm._group import resolve_group
from ..comm.agree import agree
from ..errors import ShardkitError
from .paths import check_inside, regular_file_inside

if TYPE_CHECKING:
    from .._types import Group

__all__ = [
    "MANIFEST",
    "LATEST",
    "latest_checkpoint",
    "resolve_checkpoint",
    "begin_save",
    "commit_save",
    "broadcast_from_first",
    "read_manifest",
    "complete_saves",
]

MANIFEST = "MANIFEST.json"
LATEST = "latest"
_SAVE_NAME = re.compile(r"[a-z]+_[0-9]{8,}")  # <prefix><NNNNNNNN>: the only names `latest` may hold


def broadcast_from_first(group: Group, value):
    """Rank 0's ``value`` (anything JSON carries; tuples come back as lists) on every rank of
    ``group``. JSON, not pickle (:func:`~shardkit.comm.agree.agree`): a peer's bytes never run code."""
    g = resolve_group(group, "checkpoint")
    return agree(g, "checkpoint", None, value if g.rank == 0 else None, gather=True)[0]


def _fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (POSIX: the directory entry is data of the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not supported here (e.g. Windows): the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old or the new content, never a mix."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the save at ``path`` (a JSON object).

    Raises:
        ShardkitError: no manifest (not a complete save), a link out of the save or not a
            regular file, unreadable, or not a JSON object.
    """
    file = os.path.join(os.fspath(path), MANIFEST)
    if os.path.lexists(file):  # a link out of the save, a FIFO: refused before it is opened
        regular_file_inside(os.fspath(path), file, "manifest")
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise ShardkitError(f"{path} has no {MANIFEST} (not a complete save)") from None
    except OSError as exc:
        raise ShardkitError(f"cannot read {file}: {exc.strerror or exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ShardkitError(f"{file} is damaged (not JSON: {exc})") from None
    if not isinstance(manifest, dict):
        raise ShardkitError(f"{file} is damaged (a JSON {type(manifest).__name__}, not an object)")
    return manifest


def complete_saves(root: str | os.PathLike, prefix: str) -> list[str]:
    """Names of the complete saves of ``prefix`` in ``root``, oldest first."""
    root = os.fspath(root)
    return sorted(
        n
        for n in os.listdir(root)
        if n.startswith(prefix) and n[len(prefix) :].isdigit() and _complete(os.path.join(root, n))
    )


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete save under ``root`` (the directory ``latest`` names), or None.

    Raises:
        ShardkitError: ``latest`` names anything but a save directly inside ``root``
            (``<prefix><8 digits>``: no path, no ``..``), ``latest`` or the save it names is a
            link resolving outside ``root`` (:mod:`.paths`), or names a directory without a
            manifest (a damaged checkpoint).
    """
    root = os.fspath(root)
    pointer = os.path.join(root, LATEST)
    if not os.path.lexists(pointer):
        return None
    try:
        regular_file_inside(root, pointer, "pointer")
    except ShardkitError as exc:
        raise ShardkitError(f"checkpoint: {exc}") from None
    try:
        with open(pointer, "rb") as f:
            name = f.read(256).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise ShardkitError(f"checkpoint: cannot read {pointer}: {exc.strerror or exc}") from None
    if not _SAVE_NAME.fullmatch(name):
        raise ShardkitError(
            f"checkpoint: {pointer} names {name!r}, which is not a save inside {root} "
            "(<prefix>_<8 digits>; a path outside the root is never followed)"
        )
    path = os.path.join(root, name)
    try:
        check_inside(root, path, "save")
    except ShardkitError as exc:
        raise ShardkitError(f"checkpoint: {exc}") from None
    if not _complete(path):
        raise ShardkitError(f"checkpoint: {pointer} names {name}, which has no {MANIFEST} (incomplete save)")
    return path


def resolve_checkpoint(path: str | os.PathLike, data_file: str) -> str:
    """The save to load at ``path``: a checkpoint root (its latest complete save), or one save's
    own directory (holding ``data_file``, e.g. DCP's ``.metadata``).

    Raises:
        ShardkitError: ``path`` is neither (no ``latest``, no data), or ``latest`` is damaged.
    """
    path = os.fspath(path)
    found = latest_checkpoint(path)
    if found is not None:
        return found
    if os.path.isfile(os.path.join(path, data_file)):
        return path
    raise ShardkitError(f"no complete checkpoint at {path} (neither a '{LATEST}' pointer nor {data_file})")


def _remove_save(path: str) -> None:
    """Remove a save: its manifest first, so that a kill half-way leaves a stale directory (which
    the next save removes), never one that looks complete with files missing. A save that is a
    symbolic link loses the link only: nothing is removed through it (it may lead into another
    checkpoint root, whose save would lose its manifest)."""
    if os.path.islink(path):
        os.unlink(path)
        return
    try:
        os.remove(os.path.join(path, MANIFEST))
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _stale(root: str, prefix: str) -> list[str]:
    return [
        n
        for n in os.listdir(root)
        if n.startswith(prefix) and os.path.isdir(os.path.join(root, n)) and not _complete(os.path.join(root, n))
    ]


def _versions(root: str, prefix: str) -> list[int]:
    return [int(n[len(prefix) :]) for n in os.listdir(root) if n.startswith(prefix) and n[len(prefix) :].isdigit()]


def begin_save(root: str | os.PathLike, prefix: str, group: Group, number: int | None = None) -> str:
    """Collective over ``group``: prepare a new save under ``root``; return its directory.

    Rank 0 creates ``root``, removes stale saves of ``prefix`` (killed before their manifest)
    and picks the directory ``<prefix><number>`` (8 digits; ``number`` None: one more than any
    save there, complete or not), which every rank then writes into.

    Raises:
        ShardkitError: on every rank, when ``root`` is a file, holds files that are not saves of
            this protocol (``root`` would mix with the user's data), a save that is a link
            resolving outside ``root``, ``number`` names a complete
            save (another run's: never replaced), or the directory cannot be written.
    """
    g = resolve_group(group, "checkpoint")
    root = os.path.abspath(os.fspath(root))
    answer: tuple[str | None, str | None] = (None, None)
    if g.rank == 0:
        try:
            answer = _prepare(root, prefix, number)
        except (OSError, ShardkitError) as exc:  # rank 0 alone saw it: agreed below, never a hang
            answer = (f"cannot prepare a save in {root}: {exc.strerror if isinstance(exc, OSError) else exc}", None)
    error, path = broadcast_from_first(group, answer)
    if error:
        raise ShardkitError(error)
    return path


def _prepare(root: str, prefix: str, number: int | None) -> tuple[str | None, str | None]:
    if os.path.exists(root) and not os.path.isdir(root):
        return f"{root} exists and is not a directory", None
    os.makedirs(root, exist_ok=True)
    foreign = [n for n in os.listdir(root) if not (n.startswith((prefix, LATEST)) or n.startswith("."))]
    if foreign:
        return f"{root} holds files that are not checkpoint saves ({sorted(foreign)[:3]}); it would be mixed", None
    if number is None:  # counted before stale saves go, so that numbers only grow
        number = max(_versions(root, prefix), default=0) + 1
    for name in os.listdir(root):  # a link out of the root is never written through nor removed
        if name.startswith(prefix):
            check_inside(root, os.path.join(root, name), "save")
    for name in _stale(root, prefix):
        _remove_save(os.path.join(root, name))
    for name in os.listdir(root):  # a pointer update killed before its os.replace
        if name.startswith(f"{LATEST}.tmp-"):
            os.remove(os.path.join(root, name))
    name = f"{prefix}{number:08d}"
    path = os.path.join(root, name)
    latest = latest_checkpoint(root)
    if latest is not None and os.path.basename(latest) == name:
        # Writing into the latest save would leave no complete checkpoint while it runs.
        return f"{path} is the latest complete save and is never overwritten in place", None
    if _complete(path):  # another run's complete save (this run's numbers only grow): never replaced
        return (
            f"{path} is a complete save of an earlier run; a save never replaces it (resume from it with "
            "--resume, or choose another directory)"
        ), None
    return None, os.path.join(root, name)


def commit_save(path: str, manifest: dict, group: Group, keep: int | None = None) -> None:
    """Collective over ``group``, after every rank finished writing ``path``: rank 0 writes the
    manifest, then points ``latest`` at ``path``, then keeps only the newest ``keep`` saves
    (None: all). No rank returns before ``latest`` names the new save.

    Raises:
        ShardkitError: on every rank, when rank 0 could not write the manifest or the pointer
            (the previous save stays the latest).
    """
    g = resolve_group(group, "checkpoint")
    error = None
    if g.rank == 0:
        root, name = os.path.split(path)
        try:
            _atomic_text(os.path.join(path, MANIFEST), json.dumps(manifest, indent=2))
            _atomic_text(os.path.join(root, LATEST), name)
        except OSError as exc:
            error = f"the data of {path} is complete but committing it failed: {exc}"
        if error is None and keep is not None:
            prefix = name.rstrip("0123456789")
            older = sorted(n for n in os.listdir(root) if n.startswith(prefix) and n < name)
            for old in older[: max(0, len(older) - (keep - 1))]:
                _remove_save(os.path.join(root, old))
    error = broadcast_from_first(group, error)
    if error:
        raise ShardkitError(error)
