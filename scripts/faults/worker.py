"""The job side of a fault trial: the launcher process (:func:`job`, as ``shardkit train`` runs
:func:`shardkit.cli.launch.launch_local`) and one rank (:func:`worker`), which dies where the plan says."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from contextlib import nullcontext

from torch.distributed.elastic.multiprocessing.errors import record

from .common import NPROC, TP_PLAN, sgd_losses, train_cfg, trial_model

# file-system operations a save performs (audit events; os.replace raises "os.rename")
_FS_EVENTS = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate")


def _die(plan: dict, rank: int) -> None:
    """SIGKILL this rank (or the whole job: the launcher, then this rank), noting when."""
    with open(os.path.join(plan["dir"], "killed"), "w") as f:
        # the thread: an --async-checkpoint save dies on its background thread, not the main one
        f.write(json.dumps({"rank": rank, "time": time.time(), "thread": threading.current_thread().name}))
    if plan.get("whole_job"):
        os.kill(os.getppid(), signal.SIGKILL)  # its ranks die with it (PR_SET_PDEATHSIG)
    os.kill(os.getpid(), signal.SIGKILL)


def _is_fs_op(event: str, args: tuple) -> bool:
    """An audit event that changes the file system: a file opened for writing, or one of
    :data:`_FS_EVENTS`."""
    if event == "open":
        return len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+")
    return event in _FS_EVENTS


def _in_window(plan: dict, event: str, args: tuple, state: dict) -> bool:
    """Is this file-system operation part of the targeted save? Every one, unless the plan
    names the save by a path fragment (``after``): from the first operation on a path holding it
    until one on a path holding ``until`` (the next save)."""
    if "after" not in plan:
        return True
    paths = " ".join(str(a) for a in args if isinstance(a, (str, bytes, os.PathLike)))
    if plan["until"] in paths:
        state["done"] = True
    if plan["after"] in paths:
        state["open"] = True
    return state.get("open", False) and not state.get("done", False)


def _arm_save_kill(plan: dict, rank: int) -> None:
    """Die right before the k-th file-system operation from now (of the targeted save), or after
    a delay in a thread."""
    if plan.get("delay") is not None:
        timer = threading.Timer(plan["delay"], _die, (plan, rank))
        timer.daemon = True
        timer.start()
        return
    count, state = [0], {}

    def hook(event: str, args: tuple) -> None:
        if _is_fs_op(event, args) and _in_window(plan, event, args, state):
            count[0] += 1
            if count[0] == plan["k"]:
                _die(plan, rank)

    sys.addaudithook(hook)


def _count_save_events(plan: dict, rank: int) -> None:
    """Calibration: write how many file-system operations this rank's save performs."""
    count, state = [0], {}

    def hook(event: str, args: tuple) -> None:
        if _is_fs_op(event, args) and _in_window(plan, event, args, state):
            count[0] += 1

    sys.addaudithook(hook)
    plan["_count"] = count


def _hold_after_saves(go_on: str) -> None:
    """Job A of ``writers``: after each save, wait (at most 120 s) until the file ``go_on``
    exists (the observer makes it once both B's ended), so that B always meets A running."""
    import shardkit.train.saving as saving  # the trainer's own name for it (imported at the top of saving.py)

    real = saving.save_train_state

    def held(*args, **kwargs):
        path = real(*args, **kwargs)
        end = time.monotonic() + 120
        while not os.path.exists(go_on) and time.monotonic() < end:
            time.sleep(0.05)
        return path

    saving.save_train_state = held


def _train_worker(plan: dict, rank: int, victim: bool) -> None:
    """One rank of a trainer run: ``tp`` over both ranks, a save every step (killed, or a
    ``writers`` job)."""
    import dataclasses

    import torch

    from shardkit.train.run import train

    if victim:
        _arm_save_kill(plan, rank)
    if plan.get("calibrate"):
        _count_save_events(plan, rank)
    if plan.get("go_on"):
        _hold_after_saves(plan["go_on"])
    ckpt = plan.get("ckpt") or os.path.join(plan["dir"], "ckpt")
    steps = {"steps": plan["steps"]} if plan.get("steps") else {}
    if plan.get("past_validation"):  # B of `writers`: validated on an empty directory, then pointed at A's
        cfg = dataclasses.replace(
            train_cfg(NPROC, tp=NPROC, checkpoint_dir=os.path.join(plan["dir"], "empty"), **steps), checkpoint_dir=ckpt
        )
    else:
        cfg = train_cfg(NPROC, tp=NPROC, checkpoint_dir=ckpt, async_checkpoint=plan.get("async", False), **steps)
    train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    if plan.get("calibrate"):
        with open(os.path.join(plan["dir"], f"count{rank}"), "w") as f:
            f.write(json.dumps({"events": plan["_count"][0], "seconds": 0.0}))


@record
def worker(plan: dict) -> None:
    """One rank of a trial job (run by :func:`shardkit.cli.launch.launch_local`)."""
    from datetime import timedelta

    from shardkit._local_world import init_local_world
    from shardkit.train.liveness import Heartbeat

    rank = int(os.environ["RANK"])
    victim = rank == plan.get("victim")
    moment = plan.get("moment")
    if victim and moment == "before_init":
        _die(plan, rank)
    init_local_world(plan["run_dir"], timedelta(seconds=plan.get("timeout", 60)))
    # the stall scenario: beat as `shardkit train`'s ranks do (worker_main), from a context that
    # marks the file `exiting` however the rank leaves its work: a rank failing after its peer
    # stopped is leaving, not stalled, while its interpreter tears torch down (seconds under load)
    beating = Heartbeat(os.path.join(plan["run_dir"], "flight"), rank) if plan.get("timeout") else nullcontext()
    with beating:
        _work(plan, rank, victim, moment)


def _work(plan: dict, rank: int, victim: bool, moment: str | None) -> None:
    """The body of one rank of a trial job, in its world; dies where the plan says."""
    import torch
    import torch.distributed as dist

    from shardkit import apply_tp, save_sharded_checkpoint

    world = dist.group.WORLD
    if plan["kind"] == "train":
        _train_worker(plan, rank, victim)
        dist.destroy_process_group()
        return
    if victim and moment == "model_load":
        import threading

        threading.Timer(random.Random(plan["seed"]).uniform(0, 0.05), _die, (plan, rank)).start()
    model = apply_tp(trial_model(plan["seed"]), world, TP_PLAN, check="off")
    dist.barrier()
    with open(os.path.join(plan["dir"], f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    ckpt = os.path.join(plan["dir"], "ckpt")
    if plan["kind"] == "save":
        save_sharded_checkpoint(model, ckpt, world)  # the previous checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        dist.barrier()
        if victim:
            _arm_save_kill(plan, rank)
        if plan.get("calibrate"):
            _count_save_events(plan, rank)
        start = time.time()
        save_sharded_checkpoint(model, ckpt, world)
        if plan.get("calibrate"):
            with open(os.path.join(plan["dir"], f"count{rank}"), "w") as f:
                f.write(json.dumps({"events": plan["_count"][0], "seconds": time.time() - start}))
        dist.barrier()
        dist.destroy_process_group()
        return
    step = 0
    while plan.get("forever") or step < 3:
        if victim and moment == "collective" and step == 1:
            time.sleep(random.Random(plan["seed"]).uniform(0, 0.1))  # the peer is inside all_reduce
            _die(plan, rank)
        sgd_losses(model, 1, world)
        step += 1
    if victim and moment == "save":
        _arm_save_kill(plan, rank)
    save_sharded_checkpoint(model, ckpt, world)
    dist.barrier()
    dist.destroy_process_group()
    if victim and moment == "end":
        _die(plan, rank)


def job(plan: dict) -> int:
    """The launcher process of a trial: :func:`launch_local` as ``shardkit train`` uses it."""
    from shardkit._local_world import private_run_dir
    from shardkit.cli.launch import LaunchFailed, LaunchInterrupted, exit_now, launch_local, print_failure

    code = 0
    with private_run_dir() as run_dir:
        try:
            beats = os.path.join(run_dir, "flight") if plan.get("timeout") else None
            launch_local(
                NPROC,
                worker,
                {**plan, "run_dir": run_dir},
                run_dir=run_dir,
                heartbeats=beats,
                timeout_s=plan.get("timeout", 60),
                preload=(),  # forked from a forkserver, as `shardkit train` starts its ranks
            )
        except (LaunchFailed, LaunchInterrupted) as err:
            code = print_failure(err)
    if code:
        exit_now(code)  # as `shardkit train` does
    return 0


# --------------------------------------------------------------------------- observer side
