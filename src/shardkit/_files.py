"""Files a run writes for the user (reports, images): replaced atomically, never half-written."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write"]


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
