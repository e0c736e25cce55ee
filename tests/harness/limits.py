"""Wall limits that hold on a loaded machine (issue 23, item 8).

Every wall limit of the suite (a world test's HANG limit, a subprocess's ``timeout=``) is set at
5 times or more the test's time on a quiet machine. On a shared 2-core machine at load 10 each
process gets a fifth of a core, so a limit that is 5 times the quiet time would just fire:
:func:`patient` stretches a limit by the machine's load per core when the limit is armed. A real
hang is still reported, later by the same factor (at most :data:`MAX_STRETCH`).
"""

from __future__ import annotations

import os

__all__ = ["MAX_STRETCH", "load_stretch", "patient"]

MAX_STRETCH = 10.0
"""The most a limit is stretched: a real hang on a very busy machine is reported within 10 times its limit."""


def load_stretch() -> float:
    """How many times slower than quiet this machine runs now: the 1-minute load average per
    core, between 1 and :data:`MAX_STRETCH`."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform: assume quiet
        return 1.0
    return min(MAX_STRETCH, max(1.0, load / (os.cpu_count() or 1)))


def patient(seconds: float) -> float:
    """``seconds`` (a wall limit set for a quiet machine), stretched by :func:`load_stretch`."""
    return seconds * load_stretch()
