"""``shardkit export``: a save of ``shardkit train`` as a Hugging Face model directory.

``shardkit export --checkpoint-dir DIR --out HF_DIR [--step N]`` writes ``config.json``,
safetensors shards of the full parameters and the run's tokenizer (a README for byte-level
runs) from the latest save of ``DIR`` (or the one at step ``N``), whatever layout wrote it
(:func:`shardkit.export_hf`). One process, no launch.
"""

from __future__ import annotations

import argparse
import sys

from .._optional import require
from ..checkpoint import export_hf
from ..errors import ShardkitError

__all__ = ["add_export_parser", "run_export"]


def add_export_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``export`` to the ``shardkit`` subcommands."""
    p = commands.add_parser(
        "export",
        help="write a save of shardkit train as a Hugging Face model directory",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="the --checkpoint-dir of shardkit train")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="a new or empty directory to write")
    p.add_argument("--step", type=int, default=None, help="the save to export (default: the latest)")
    p.add_argument(
        "--allow-unverified",
        action="store_true",
        help="export a save whose manifest has no checksums (one of an earlier shardkit); refused without it",
    )
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Run ``export``; return the exit code (2 with one line on stderr for bad input)."""
    try:
        require(["transformers"], "shardkit export")
        out = export_hf(args.checkpoint_dir, args.out, args.step, allow_unverified=args.allow_unverified)
    except ShardkitError as exc:
        print(f"shardkit export: error: {exc}", file=sys.stderr)
        return 2
    print(f"shardkit export: wrote {out} (load it with AutoModelForCausalLM.from_pretrained({out!r}))")
    return 0
