"""Paired, interleaved benchmark of ``shardkit.all_to_all`` (docs/design.md, Benchmarks).

Same as ``shardkit bench``; see ``python benchmarks/bench_all_to_all.py --help``.
"""

import sys

from shardkit.cli.bench import main

if __name__ == "__main__":  # spawned ranks re-import this file; only the parent runs
    sys.exit(main())
