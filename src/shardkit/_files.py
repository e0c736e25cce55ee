"""Files a run writes for the user (reports, images): replaced atomically, never half-written;
JSON with no ``NaN`` / ``Infinity`` tokens (they are not JSON: strict parsers refuse the file);
an export's output folder checked before anything is written (no torch: ``shardkit train``
checks ``--save-hf`` before importing it)."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ShardkitError

__all__ = ["atomic_write", "finite_json", "check_out_dir"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Write ``path`` via a temporary file in the same folder and ``os.replace``.

    ``write(tmp_path)`` produces the content. A reader never sees a half-written file, and a
    failure leaves any existing ``path`` untouched (only the temporary file is removed).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def finite_json(value: Any, where: str = "") -> tuple[Any, list[str]]:
    """``value`` with every non-finite float (NaN, +-inf) replaced by None, and where they were
    (``"loss"``, ``"losses[3]"``, ``"parity.max_loss_rel_diff"``), for ``json.dumps(...,
    allow_nan=False)``: the writer records the list as a flag next to the nulls."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, [where or "value"]
    found: list[str] = []
    if isinstance(value, dict):
        out: dict = {}
        for k, v in value.items():
            out[k], bad = finite_json(v, f"{where}.{k}" if where else str(k))
            found += bad
        return out, found
    if isinstance(value, list | tuple):
        items = []
        for i, v in enumerate(value):
            item, bad = finite_json(v, f"{where}[{i}]")
            items.append(item)
            found += bad
        return items, found
    return value, found


def check_out_dir(out_dir: str | os.PathLike, flag: str) -> None:
    """Refuse an output directory an export would mix with other files (pure: the file system).

    Raises:
        ShardkitError: naming ``flag``: ``out_dir`` is empty text, a file, or a non-empty directory.
    """
    out = os.fspath(out_dir)
    if not out.strip():
        raise ShardkitError(f"{flag}: give a directory")
    if os.path.islink(out) and not os.path.exists(out):
        raise ShardkitError(f"{flag} {out!r} is a symbolic link to {os.readlink(out)!r}, which does not exist")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ShardkitError(f"{flag} {out!r} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise ShardkitError(f"{flag} {out!r} is not empty; the export would mix with its files: choose a new directory")
