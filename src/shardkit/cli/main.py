"""The ``shardkit`` command: ``shardkit train``, ``shardkit plan``, ``shardkit bench`` and ``shardkit export``.

Only the parser of the command being run is built: the others are one-line entries of
:data:`.commands.COMMANDS`, so ``shardkit --help`` imports neither torch nor the application.
A mistyped command or flag is answered with the closest known ones (``difflib``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Iterable
from typing import NoReturn

from .. import __version__
from .commands import COMMANDS

__all__ = ["build_parser", "main", "suggest"]


def suggest(word: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the close matches of ``word`` in ``known``, else ``""``."""
    options = list(known)
    # --tp-size -> --tp: a known flag that the word extends comes first, then the near spellings
    extends = sorted((o for o in options if o.startswith("--") and word.startswith(o + "-")), key=len)[-1:]
    matches = extends + [m for m in difflib.get_close_matches(word, options, n=3, cutoff=0.6) if m not in extends]
    return f" (did you mean {' or '.join(matches[:3])}?)" if matches else ""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose "invalid choice" errors name the closest choices."""

    def error(self, message: str) -> NoReturn:
        for action in self._actions:
            name = "/".join(action.option_strings) or action.metavar or action.dest
            if action.choices is not None and message.startswith(f"argument {name}: invalid choice: "):
                word = message.split("invalid choice: ", 1)[1].split("'")[1]
                message += suggest(word, [str(c) for c in action.choices])
        super().error(message)


def _command_parsers(name: str) -> Callable:
    """The ``add_*_parser`` of one command (imported here: only the command being run pays for it)."""
    if name == "train":
        from .train import add_train_parser

        return add_train_parser
    if name == "plan":
        from .plan import add_plan_parser

        return add_plan_parser
    if name == "export":
        from .export import add_export_parser

        return add_export_parser
    from .bench import add_bench_parser

    return add_bench_parser


def _build(full: Iterable[str]) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = _Parser(prog="shardkit", description="Hybrid model parallelism on gloo and NCCL.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    built = {}
    for name, text in COMMANDS.items():
        if name in full:
            built[name] = _command_parsers(name)(commands)
        else:
            commands.add_parser(name, help=text)  # listed only; parsed only if it is the command run
    return parser, built


def build_parser(full: Iterable[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command.

    Args:
        full: the commands whose flags are added (default all); the others are listed with their
            one-line help only, and their modules are not imported.
    """
    return _build(tuple(full))[0]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code.

    An unknown flag is reported by its command's parser (its usage, not the top-level one), with
    the closest flags of that command. Without ``argv`` the command is this process's own
    (``own_process``): ``shardkit train`` then starts its forkserver before its torch-dependent
    checks, which a program calling ``main(argv)`` (with a forkserver of its own, as pytest's
    harness has) is spared.
    """
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser, built = _build([command] if command is not None and command in COMMANDS else [])
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = built[args.command]
        known = [o for a in sub._actions for o in a.option_strings]
        unknown = [e for e in extras if e.startswith("-")] or extras
        sub.error(f"unrecognized arguments: {' '.join(extras)}" + suggest(unknown[0].split("=")[0], known))
    args.own_process = own_process
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
