"""Imported first by the forkserver of a local launch (``launch_local(preload=...)``), and only
there: the forkserver dies the moment its launcher dies, even by SIGKILL, and runs in a session
of its own.

Its ranks die with it (:func:`.launch._die_with_launcher`). Without this the forkserver would
notice the launcher's end only as an end of file on its pipe, then unwind an interpreter holding
torch and transformers for seconds (under load) while its ranks live on. Linux only: elsewhere
there is no ``prctl`` and the forkserver ends on that end of file. A thread (the other platforms'
fallback in :func:`.launch._die_with_parent`) must not start here: the forkserver forks.

Its own session: Linux's scheduler shares the processors between sessions first (autogroups,
on by default), then between the processes of one session. In the launcher's session the
forkserver's imports and the launcher's checks would split one share; torchrun starts each rank
in a new session (``start_new_session``), so each of its ranks competes as a session of its own
on a loaded machine (issue 32: measured 1 share against 4). Each forked rank takes its own
session too (:func:`.launch._quiet_then`). Nothing is lost: the forkserver has no terminal
signals to get (the launcher forwards SIGINT / SIGTERM to the ranks) and dies with the launcher.
"""

from __future__ import annotations

import os
import sys

from .launch import _die_with_parent, _own_session

if sys.platform.startswith("linux"):
    _die_with_parent(os.getppid())
_own_session()
