"""The ``shardkit`` subcommands: name -> one-line help, in one place.

:mod:`.main` lists every command from this table and builds (imports) only the parser of the
command being run, so ``shardkit --help`` and a mistyped command import none of them.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["COMMANDS"]

COMMANDS = MappingProxyType(
    {
        "train": "train a Hugging Face causal LM (or a conv autoencoder) with any composition of "
        "dp x pp x cp x tp x ep",
        "plan": "rank the layouts of a model on a cluster by predicted step time",
        "bench": "paired, interleaved benchmarks of every axis (docs/design.md, Benchmarks)",
        "export": "write a save of shardkit train as a Hugging Face model directory",
    }
)
"""Subcommand -> its one-line help (``shardkit --help``)."""
