"""Fault trials: kill workers and the launcher at chosen moments, kill saves half-way; count outcomes.

``python scripts/fault_trials.py launcher [--runs 20] [--json PATH]``
    Each scenario ``--runs`` times, on a 2-rank local launch (:func:`shardkit.cli.launch.launch_local`,
    the launcher of ``shardkit train``) of a small tensor-parallel job (init, model, training steps
    with collectives, a sharded checkpoint save): SIGKILL of a random worker before
    ``init_process_group``, during model load, inside a step's collective, during the checkpoint
    save, after the work; SIGINT, SIGTERM and SIGKILL to the launcher while the ranks train;
    SIGSTOP of a random worker while the ranks train (a stalled rank: process-group timeout 5 s,
    the ranks beat heartbeats). A run passes when every process of the job (its session, found
    through ``/proc``) is gone within 5 s of the fault (35 s, the timeout + 30 s, for the stall),
    the exit code is right (1; 130; 143; -9 for a SIGKILLed launcher) and, for a worker fault, the
    root cause (``rank R failed first`` with ``SIGKILL``; for the stall ``rank R stopped answering
    first (suspect)``) is printed.

``python scripts/fault_trials.py save [--runs 50] [--json PATH]``
    Each run saves a checkpoint with :func:`shardkit.save_sharded_checkpoint` (2 ranks), changes
    the weights and saves again; the second save is killed at a random moment: SIGKILL of rank 0,
    of rank 1, or of the whole job (the launcher, whose ranks follow it), either right before a
    random one of the victim's file-system operations of that save (``sys.addaudithook``: open
    for writing, rename / replace, remove, mkdir, rmtree) or after a random delay. Then, in this
    process: the latest save loads bit-exactly (the first save's weights, or the second's if its
    ``latest`` pointer was already replaced), training from it gives the same losses as from
    those weights, and the next save removes the killed one's partial directory.

``python scripts/fault_trials.py save --trainer [--runs 10] [--json PATH]``
    The same kills in the trainer itself: a 2-rank ``tp=2`` float64 run of the composed trainer
    (:func:`shardkit.train.run.train`, what ``shardkit train`` runs on each rank) saving every
    step (``--save-every 1``) is killed inside its step-2 save (rank 0, rank 1 or the whole job,
    before a random one of the victim's file-system operations of that save). Then, in this
    process (one rank, another layout): the latest checkpoint is step 1 or step 2, ``--resume``
    continues from it with the same per-step losses as an uninterrupted run (float64, 1e-12),
    and its own saves leave no partial directory behind.

``python scripts/fault_trials.py writers [--runs 3] [--json PATH]``
    Two jobs on one ``--checkpoint-dir``: job A (the 2-rank ``tp=2`` trainer, a save every step,
    holding after its first save until B's attempts ended) is running when job B starts on the
    same directory, once through ``shardkit train`` (refused before launch: exit code 2) and
    once past that check (its workers are refused by the directory's lock). A run passes when
    both B's are refused with a message naming A's run id, host and pid, A ends with exit code
    0, every save of A is complete with ``latest`` at its last step, and ``--resume`` (here, one
    rank) continues from that step.

``python scripts/fault_trials.py saturated --tokenizer DIR [--busy 48] [--min-load 40] [--runs 1]``
    Issue 31, finding 1, by hand: ``--busy`` processes spinning at normal priority raise the
    1-minute load average above ``--min-load``, then ``shardkit train --tokenizer DIR --data FILE
    --tp 2 --steps 10 --save-hf OUT`` runs (4 ranks, as the finding's command) while they keep
    spinning. A run passes when it exits 0 with the model and its tokenizer in ``OUT`` and no
    watchdog line; the load while it ran (min / median / max), its seconds and exit code are printed.

All print a table of counts; ``--json`` writes every run's record. The trials live in
``scripts/faults/`` (one module per family; ``worker.py`` is the job they kill).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `faults` beside this file, when imported
from faults import launcher, saturated, save, writers  # noqa: E402
from faults.launcher import SCENARIOS, limit_s, run_fault  # noqa: E402
from faults.save import calibrate_save, run_save  # noqa: E402
from faults.writers import run_writers  # noqa: E402

__all__ = ["SCENARIOS", "calibrate_save", "limit_s", "main", "run_fault", "run_save", "run_writers"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=("launcher", "save", "writers", "saturated"))
    parser.add_argument(
        "--runs", type=int, default=None, help="runs per scenario (launcher 20) or in all (save 50, save --trainer 10)"
    )
    parser.add_argument("--trainer", action="store_true", help="save: kill the trainer's own save and --resume")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="launcher: only these scenarios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", metavar="DIR", help="saturated: the tokenizer directory of the command")
    parser.add_argument("--data", default=json.__file__, help="saturated: the text the command trains on")
    parser.add_argument("--busy", type=int, default=48, help="saturated: spinning processes (default 48)")
    parser.add_argument("--min-load", type=float, default=40.0, help="saturated: load average to reach first")
    parser.add_argument("--steps", type=int, default=10, help="saturated: the command's --steps")
    parser.add_argument("--nproc", type=int, help="saturated: the command's --nproc (default: its own, 4)")
    parser.add_argument("--json", metavar="PATH", help="write every run's record here")
    args = parser.parse_args(argv)
    if args.family == "saturated":
        if not args.tokenizer:
            parser.error("saturated needs --tokenizer DIR")
        records = saturated.main(
            args.runs or 1, args.tokenizer, args.data, args.busy, args.min_load, args.steps, args.nproc
        )
    elif args.family == "writers":
        records = writers.main(args.runs or 3, args.seed)
    elif args.family == "launcher":
        records = launcher.main(args.runs or 20, args.scenario, args.seed)
    else:
        records = save.main(args.runs or (10 if args.trainer else 50), args.trainer, args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_job":  # a trial job, started by faults.common.start_job
        from faults.worker import job

        sys.exit(job(json.loads(sys.argv[2])))
    sys.exit(main())
