"""The ``shardkit`` command line (``python -m shardkit`` is the same)."""

from .main import main

__all__ = ["main"]
