"""No symbolic link is followed out of a checkpoint root.

A checkpoint root may itself be reached through a link (``--checkpoint-dir`` on a scratch
mount), so the boundary is the root's real path; inside it, a save directory, the ``latest``
pointer and every file of a save must resolve inside that boundary. A save that is a link into
another root would otherwise be loaded, exported or (by ``--keep``) deleted there.

Source: the ``realpath`` containment check of tools that extract archives safely (e.g. Python's
``tarfile`` data filter), applied to a directory the user points at.
"""

from __future__ import annotations

import os
import stat

from ..errors import ShardkitError

__all__ = ["resolves_inside", "check_inside", "regular_file_inside"]


def resolves_inside(boundary: str, path: str) -> bool:
    """Whether ``path``, every link followed, lies inside ``boundary`` (itself resolved)."""
    real, top = os.path.realpath(path), os.path.realpath(boundary)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def check_inside(boundary: str, path: str, what: str) -> None:
    """Refuse ``path`` (a ``what``: "save", "pointer") resolving outside ``boundary``.

    Raises:
        ShardkitError: naming ``path``, where it leads and the boundary.
    """
    if not resolves_inside(boundary, path):
        raise ShardkitError(
            f"{path}: this {what} is a symbolic link to {os.path.realpath(path)}, outside the checkpoint "
            f"directory {boundary}; a link out of a checkpoint is never followed (loaded, exported or deleted)"
        )


def regular_file_inside(boundary: str, path: str, what: str) -> int:
    """The size of ``path``, a regular file resolving inside ``boundary``.

    Raises:
        ShardkitError: a link out of ``boundary``, missing or unreadable, or not a regular file
            (a FIFO or a device would block or never end).
    """
    check_inside(boundary, path, what)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ShardkitError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ShardkitError(f"{path}: this {what} is not a regular file; refused")
    return st.st_size
