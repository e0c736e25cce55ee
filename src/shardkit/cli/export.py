"""``shardkit export``: a save of ``shardkit train`` as a Hugging Face model directory.

``shardkit export --checkpoint-dir DIR --out HF_DIR [--step N]`` writes ``config.json``,
safetensors shards of the full parameters and the run's tokenizer (a README for byte-level
runs) from the latest save of ``DIR`` (or the one at step ``N``), whatever layout wrote it
(:func:`shardkit.export_hf`), and says which step it exported. One process, no launch. The model
is written beside ``HF_DIR`` and renamed to it at the end: SIGTERM or SIGINT on the way (exit
code 143 / 130) leaves nothing at ``HF_DIR``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .._optional import require
from .._quiet import no_progress_bars
from ..checkpoint import export_hf
from ..checkpoint.export import find_save
from ..checkpoint.versioned import read_manifest
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


class _Terminated(BaseException):
    """SIGTERM during the export: unwinds like KeyboardInterrupt, so the partial directory is removed."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def run_export(args: argparse.Namespace) -> int:
    """Run ``export``; return the exit code (2 with one line on stderr for bad input; 143 after
    SIGTERM, 130 after SIGINT, with nothing left at ``--out``)."""
    main = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
    try:
        require(["transformers"], "shardkit export")
        no_progress_bars()  # transformers' bars (tokenizer, weights) would leak into the one line said below
        save = find_save(args.checkpoint_dir, args.step)
        out = export_hf(save, args.out, allow_unverified=args.allow_unverified)
        step = read_manifest(save).get("step")
    except ShardkitError as exc:
        print(f"shardkit export: error: {exc}", file=sys.stderr)
        return 2
    except (_Terminated, KeyboardInterrupt) as exc:
        name, code = ("SIGTERM", 143) if isinstance(exc, _Terminated) else ("SIGINT", 130)
        print(f"shardkit export: stopped by {name}; nothing was written to {args.out!r}", file=sys.stderr)
        return code
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    print(
        f"shardkit export: wrote step {step} ({save}) to {out} "
        f"(load it with AutoModelForCausalLM.from_pretrained({out!r}))"
    )
    return 0
