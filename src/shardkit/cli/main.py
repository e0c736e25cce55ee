"""The ``shardkit`` command: ``shardkit train``, ``shardkit plan``, ``shardkit bench`` and ``shardkit export``."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from .bench import add_bench_parser
from .export import add_export_parser
from .plan import add_plan_parser
from .train import add_train_parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(prog="shardkit", description="Hybrid model parallelism on gloo and NCCL.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_parser(commands)
    add_plan_parser(commands)
    add_bench_parser(commands)
    add_export_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
