"""Imported first by the forkserver of a local launch (``launch_local(preload=...)``), and only
there: the forkserver dies the moment its launcher dies, even by SIGKILL.

Its ranks die with it (:func:`.launch._die_with_launcher`). Without this the forkserver would
notice the launcher's end only as an end of file on its pipe, then unwind an interpreter holding
torch and transformers for seconds (under load) while its ranks live on. Linux only: elsewhere
there is no ``prctl`` and the forkserver ends on that end of file. A thread (the other platforms'
fallback in :func:`.launch._die_with_parent`) must not start here: the forkserver forks.
"""

from __future__ import annotations

import os
import sys

from .launch import _die_with_parent

if sys.platform.startswith("linux"):
    _die_with_parent(os.getppid())
