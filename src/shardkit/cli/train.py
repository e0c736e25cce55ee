"""``shardkit train``: the command-line side (flags, checks, launch, summary, report).

Options come from defaults, then ``--config FILE.toml``, then the flags given; the layout is
checked before any process starts. Without torchrun, ``--nproc`` local CPU processes are started
with gloo; under torchrun the existing world is used (NCCL on GPUs, else gloo).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING

from .._optional import check_train, require
from .._quiet import no_progress_bars, quiet_third_party
from ..errors import ShardkitError
from ..train.options import TrainConfig
from .train_flags import add_train_flags

if TYPE_CHECKING:
    from ._fork import Forkserver

# The flags need only the two modules above (no torch: `shardkit train --help` stays fast); the
# checks, the launch and the report import the application inside the functions that run them.

__all__ = ["add_train_parser", "config_from_args", "check_args", "finish_args", "run_train", "LOG_WIDTH"]

LOG_WIDTH = 100_000  # the summary's width when stdout is no terminal (finish): rows never wrap
# The module of the ranks' entry (shardkit.train.run.worker_main), named without importing it:
# the forkserver imports it while the launcher checks the options (tests/cli/test_launch_start.py
# holds it to the function's module).
ENTRY_MODULE = "shardkit.train.run"


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand (its flags: :func:`.train_flags.add_train_flags`)."""
    p = add_train_flags(subparsers)
    p.set_defaults(func=run_train)
    return p


def config_from_args(args: argparse.Namespace, world_size: int | None = None) -> TrainConfig:
    """Merge defaults, the TOML file and the flags; validate (:func:`check_args`, then
    :func:`finish_args`).

    Raises:
        ShardkitError: a bad file, option or layout.
    """
    return finish_args(*check_args(args, world_size), world_size)


def check_args(args: argparse.Namespace, world_size: int | None = None) -> tuple[TrainConfig, int | None]:
    """The checks that need no library module, run before anything imports torch (issue 32):
    the ``--config`` file (keys and types), the options and the world's arithmetic
    (:func:`~shardkit.train.layout.check_options`: degrees against ``--nproc``, the batch, the
    output folders, ...), ``--tokenizer``'s files and the ``--data`` corpus (regular files, JSONL
    lines, its size). Returns the checked options and the corpus's size (bytes; 0 for a model
    that reads none, None where unknown) for :func:`finish_args`.

    Raises:
        ShardkitError: a bad file, option or layout.
    """
    from ..train.config_file import load_toml, merge_config
    from ..train.data import check_corpus
    from ..train.layout import check_options
    from ..train.model_names import model_facts
    from ..train.pretrained import tokenizer_source

    values = {k: v for k, v in vars(args).items() if k not in ("func", "command", "own_process")}
    file_values = load_toml(args.config) if args.config else {}
    checked = check_options(merge_config(file_values, values), world_size)
    if checked.tokenizer is not None:
        tokenizer_source(checked.tokenizer, "--tokenizer")  # a folder without tokenizer files: fails here
    # A missing, unreadable, not regular or too short --data, or a bad JSONL line, fails here
    # (stat and open only; a FIFO is never opened for reading blocking).
    reads_corpus = model_facts(checked.model).reads_corpus
    size = check_corpus(checked.data, checked.data_column, checked.seq_len) if reads_corpus else 0
    return checked, size


def finish_args(checked: TrainConfig, size: int | None, world_size: int | None = None) -> TrainConfig:
    """The rest of :func:`~shardkit.train.config.validate_config` on :func:`check_args`'s
    result (the schedule, the model's own rules, the mesh) and the machine's limits: these
    import torch.

    Raises:
        ShardkitError: a bad option, layout or file.
    """
    # From here on the checks need the model specs, the mesh and the planner: they import torch.
    from ..train.checkpoint_dir import check_checkpoint_dir
    from ..train.config import finish_config
    from ..train.data import held_out_start
    from ..train.limits import check_machine
    from ..train.pretrained import load_text_tokenizer
    from ..train.profiling import check_memory_snapshot_device
    from ..train.specs import model_spec
    from ..train.tokens import check_checkpoint_tokenizer

    cfg = finish_config(checked)
    check_memory_snapshot_device(cfg)  # under torchrun: GPUs or not (the local launch was refused before torch)
    # What this machine and its files allow, checked against the resolved layout: cores and
    # memory, a --checkpoint-dir of this model's saves.
    check_machine(cfg, local_launch=world_size is None)
    resumed = check_checkpoint_dir(cfg)
    if resumed is not None and (world_size is None or int(os.environ.get("RANK", "0")) == 0):
        print(resumed, file=sys.stderr)  # said before any process starts: what this run continues
    if cfg.model_path is not None:
        check_checkpoint_tokenizer(cfg.model_path)  # a folder of weights alone: fails here, not in every worker
    if cfg.tokenizer is not None:
        load_text_tokenizer(cfg.tokenizer, "--tokenizer")  # files that transformers cannot load: fail here
    if not model_spec(cfg.model).reads_corpus:
        return cfg  # e.g. conv-ae: its data is matplotlib's sample photo, not a text corpus
    if (
        cfg.eval_every and cfg.model_path is None and cfg.tokenizer is None and size is not None
    ):  # byte tokens of files: the split is known before launch
        held_out_start(size, cfg.seq_len)
    return cfg


def run_train(args: argparse.Namespace) -> int:
    """Run the ``train`` subcommand; return the process exit code."""
    from ._fork import Forkserver, modeling_modules
    from .launch import exit_now, under_torchrun  # no torch: the checks below come first

    torchrun = under_torchrun()
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else None
    forkserver = None
    no_progress_bars()  # the pre-launch checks read --model-path's config and tokenizer with transformers
    try:
        if getattr(args, "model_path", None):  # the layout check reads its config with transformers
            require(["transformers"], "shardkit train --model-path")
        if getattr(args, "tokenizer", None):
            require(["transformers"], "shardkit train --tokenizer")
        checked, size = check_args(args, world_size)
        if not torchrun and getattr(args, "own_process", False):
            # Started now, its imports (torch, the model's modeling code, shardkit's trainer) run
            # while this process imports the same for the checks below: on a loaded machine they
            # were one after the other, slower than torchrun's ranks importing side by side
            # (issue 32). A check that fails below ends this process, and the forkserver with it.
            # (Called in-process, main(argv), it starts at launch: the caller may run its own.)
            forkserver = Forkserver.start(modeling_modules(checked.model, checked.model_path), ENTRY_MODULE)
        cfg = finish_args(checked, size, world_size)
        from ..train.specs import model_spec

        spec = model_spec(cfg.model)  # a missing extra: one line, before any launch
        notes = check_train(spec.needs, f"shardkit train --model {spec.name}{spec.needs_why}", cfg.report)
    except ShardkitError as e:
        print(f"shardkit train: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"shardkit train: note: {note}", file=sys.stderr)
    from ..checkpoint.lock import REPORT_LOCK, process_lock
    from ..train.liveness import clear_flight_dir
    from ..train.run import worker_main

    # --report DIR is locked like --checkpoint-dir (DIR/.report.lock) from before the launch to the
    # last file written: two jobs would interleave metrics.jsonl and overwrite report.json. The
    # launcher holds it; under torchrun, rank 0 (whose exit makes torchrun stop the others).
    lock = ExitStack()
    try:
        if cfg.report is not None and (not torchrun or int(os.environ.get("RANK", "0")) == 0):
            lock.enter_context(process_lock(cfg.report, "shardkit train --report", REPORT_LOCK))
    except ShardkitError as e:
        print(f"shardkit train: error: {e}", file=sys.stderr)
        return 2
    with lock:
        if torchrun:
            # Every rank writes its heartbeat (and, if the job fails, its flight recorder) into
            # --report DIR/flight, after removing its own files of an earlier run; read them with
            # `python -m shardkit.comm.flight_recorder DIR/flight` after the job. No --report: none.
            flight_dir = os.path.join(cfg.report, "flight") if cfg.report else None
            if flight_dir is not None:
                clear_flight_dir(flight_dir, rank=int(os.environ["RANK"]))
            quiet_third_party(int(os.environ.get("RANK", "0")))  # progress bars and warnings on rank 0 only
            result = worker_main(cfg, None, flight_dir)
            if flight_dir is not None:  # a good run: its heartbeat is no record worth keeping
                _clear_after_good_run(flight_dir, int(os.environ["RANK"]))
            return 0 if result is None else finish(result, cfg)
        if forkserver is None:  # main(argv) in a caller's process: started at launch, as before
            forkserver = Forkserver.start(modeling_modules(cfg.model, cfg.model_path), ENTRY_MODULE)
        code, results = _launch(cfg, forkserver)
        if code is None:
            return finish(results[0], cfg)
    assert code is not None  # a launch that returned results returned above
    exit_now(code, forkserver)  # the run directory is already removed, the lock released


def _launch(cfg: TrainConfig, forkserver: Forkserver) -> tuple[int | None, dict]:
    """The local launch, in a private run directory removed when it ends (however it ends), its
    ranks forked from ``forkserver``.

    Returns ``(None, results)``, or after a failed or interrupted launch ``(exit code, {})``
    with the reason, the suspects and the flight report already printed. The ranks' heartbeats
    and flight records go to ``--report DIR/flight`` (kept), else into the run directory; those
    of an earlier run there are removed first.
    """

    from .._local_world import private_run_dir
    from ..train.liveness import clear_flight_dir
    from ..train.run import worker_main
    from ..train.saving import last_save_note
    from .launch import LaunchFailed, LaunchInterrupted, launch_local, print_failure

    assert cfg.nproc is not None  # validate_config resolved it
    with private_run_dir() as run_dir:
        flight_dir = os.path.join(cfg.report if cfg.report else run_dir, "flight")
        clear_flight_dir(flight_dir)
        try:
            results = launch_local(
                cfg.nproc,
                worker_main,
                cfg,
                run_dir,
                flight_dir,
                run_dir=run_dir,
                heartbeats=flight_dir,
                timeout_s=cfg.timeout,
                preload=forkserver,
            )
        except LaunchFailed as e:
            code = print_failure(e)
            _print_flight_report(flight_dir, cfg.nproc, kept=cfg.report is not None)
            return code, {}
        except LaunchInterrupted as e:  # SIGINT / SIGTERM: every rank is already stopped
            code = print_failure(e)
            print(f"shardkit train: {last_save_note(cfg)}", file=sys.stderr)  # what a rerun continues from
            return code, {}
        _clear_after_good_run(flight_dir)  # --report DIR keeps flight records of failed runs only
        return None, results


def _clear_after_good_run(flight_dir: str, rank: int | None = None) -> None:
    """Remove the heartbeats (every rank's, or ``rank``'s) after a good run, and the folder when
    that leaves it empty: ``--report DIR/flight`` then exists only after a failed run."""
    from ..train.liveness import clear_flight_dir

    clear_flight_dir(flight_dir, rank=rank)
    try:
        os.rmdir(flight_dir)
    except OSError:  # not empty (another rank's heartbeat, a user's file) or already gone
        pass


def _print_flight_report(flight_dir: str, nproc: int | None = None, kept: bool = True) -> None:
    """After a failed job: the first collective where the ranks diverged, from their dumps, and
    the ranks (of ``nproc``) that left none; where the records are (``kept``), or that they are
    removed with the run directory."""
    from ..comm import flight_recorder

    if os.path.isdir(flight_dir) and any(n.startswith("rank") for n in os.listdir(flight_dir)):
        print(flight_recorder.format_report(flight_dir, world_size=nproc), file=sys.stderr)
        if kept:
            print(f"(flight records of every rank: {flight_dir})", file=sys.stderr)
        else:
            print(
                "(flight records removed with the run's private directory; --report DIR keeps them in DIR/flight)",
                file=sys.stderr,
            )


def finish(result: dict, cfg: TrainConfig) -> int:
    """Print the summary (and parity), write the report; 1 if verification failed, else 0."""
    from rich.console import Console

    from .report import print_parity, print_summary, write_report

    console = Console()
    if not console.is_terminal:
        # A pipe or file has no width: rich's 80-column fallback truncates the ledger, and any fixed
        # width wraps a long layout or memory row mid-cell (at 120 a 16-rank memory row did). No
        # table here expands, so a width no row reaches prints every table at its natural width.
        console = Console(width=LOG_WIDTH)
    print_summary(result, console)
    parity = result.get("parity")
    if parity is not None:
        print_parity(parity, console)
    if cfg.save_hf:
        console.print(
            f"Hugging Face model (--save-hf, step {cfg.steps}): {cfg.save_hf}", highlight=False, soft_wrap=True
        )
    profile = result.get("profile")
    if profile is not None:  # rank 0's files; every rank wrote its own into the same folder
        a, b = profile["steps"]
        console.print(
            f"profile (steps {a}-{b}, one file per rank, Perfetto / memory_viz): {profile['dir']}",
            highlight=False,
            soft_wrap=True,
        )
    if cfg.report:
        paths = [*result.get("files", []), *write_report(result, cfg.report)]
        console.print("report: " + ", ".join(str(p) for p in paths), highlight=False)
    return 1 if parity is not None and not parity["passed"] else 0
