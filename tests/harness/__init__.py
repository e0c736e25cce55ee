"""Persistent multi-process gloo test worlds (docs/design.md, Testing).

``world`` manages the worker processes from the pytest side, ``worker`` is the rank side, and
``helpers`` are what a test body running inside a rank calls. ``tests/conftest.py`` puts the
``tests`` directory on ``sys.path``, so tests import ``harness`` as a top-level package::

    from harness.helpers import all_true, get_mesh, rank, world_size
"""
