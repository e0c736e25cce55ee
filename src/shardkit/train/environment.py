"""Where a ``shardkit train`` run ran: versions, git revision, host (``report.json``'s ``environment``)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess

import torch

from .. import __version__

__all__ = ["run_environment"]


def run_environment() -> dict:
    """Versions, git revision (of the checkout shardkit runs from, if any) and host of a run."""
    versions = {"python": platform.python_version(), "torch": torch.__version__, "shardkit": __version__}
    try:
        import transformers  # an optional extra: the conv model runs without it

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        revision = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=os.path.dirname(os.path.dirname(__file__)),
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "versions": versions,
        "git_revision": revision,
        "host": socket.gethostname(),
        "platform": platform.platform(),
    }
