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

All print a table of counts; ``--json`` writes every run's record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from torch.distributed.elastic.multiprocessing.errors import record

GONE_WITHIN_S = 5.0
NPROC = 2
HERE = os.path.abspath(__file__)
WORKER_MOMENTS = ("before_init", "model_load", "collective", "save", "end")
LAUNCHER_SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL")
STALL = "SIGSTOP worker"
SCENARIOS = (
    tuple(f"kill worker: {m}" for m in WORKER_MOMENTS) + tuple(f"{s} launcher" for s in LAUNCHER_SIGNALS) + (STALL,)
)
# The stall scenario: the ranks' process-group timeout, and how long after it the job may take to end.
STALL_TIMEOUT_S = 5.0
STALL_MARGIN_S = 30.0
# file-system operations a save performs (audit events; os.replace raises "os.rename")
_FS_EVENTS = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate")


# --------------------------------------------------------------------------- worker side


def _model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 32))


_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise"}


def _losses(model, steps: int, world=None) -> list[float]:
    """``steps`` SGD steps on fixed data; the losses (all-reduced over ``world`` when given)."""
    import torch
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if world is not None:
            dist.all_reduce(loss.detach(), group=world)
        out.append(loss.item())
    return out


def _die(plan: dict, rank: int) -> None:
    """SIGKILL this rank (or the whole job: the launcher, then this rank), noting when."""
    with open(os.path.join(plan["dir"], "killed"), "w") as f:
        f.write(json.dumps({"rank": rank, "time": time.time()}))
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
        import threading

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


# The trainer trials: a small float64 run saving every step; the step-2 save is the one killed.
TRAIN = dict(
    model="llama", steps=3, seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3, save_every=1, verify=False
)
TRAIN_WINDOW = {"after": "step_00000002", "until": "step_00000003"}


def _train_cfg(nproc: int, **kw):
    from shardkit.train.config import TrainConfig, validate_config

    return validate_config(TrainConfig(**{**TRAIN, "nproc": nproc, **kw}), world_size=nproc)


def _hold_after_saves(go_on: str) -> None:
    """Job A of ``writers``: after each save, wait (at most 120 s) until the file ``go_on``
    exists (the observer makes it once both B's ended), so that B always meets A running."""
    import shardkit.train.run as run  # the trainer's own name for it (imported at the top of run.py)

    real = run.save_train_state

    def held(*args, **kwargs):
        path = real(*args, **kwargs)
        end = time.monotonic() + 120
        while not os.path.exists(go_on) and time.monotonic() < end:
            time.sleep(0.05)
        return path

    run.save_train_state = held


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
            _train_cfg(NPROC, tp=NPROC, checkpoint_dir=os.path.join(plan["dir"], "empty"), **steps), checkpoint_dir=ckpt
        )
    else:
        cfg = _train_cfg(NPROC, tp=NPROC, checkpoint_dir=ckpt, **steps)
    train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    if plan.get("calibrate"):
        with open(os.path.join(plan["dir"], f"count{rank}"), "w") as f:
            f.write(json.dumps({"events": plan["_count"][0], "seconds": 0.0}))


@record
def worker(plan: dict) -> None:
    """One rank of a trial job (run by :func:`shardkit.cli.launch.launch_local`)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardkit import apply_tp, save_sharded_checkpoint
    from shardkit._local_world import init_local_world
    from shardkit.train.liveness import Heartbeat

    rank = int(os.environ["RANK"])
    victim = rank == plan.get("victim")
    moment = plan.get("moment")
    if victim and moment == "before_init":
        _die(plan, rank)
    init_local_world(plan["run_dir"], timedelta(seconds=plan.get("timeout", 60)))
    if plan.get("timeout"):  # the stall scenario: beat like `shardkit train` ranks, until the process ends
        Heartbeat(os.path.join(plan["run_dir"], "flight"), rank).__enter__()
    world = dist.group.WORLD
    if plan["kind"] == "train":
        _train_worker(plan, rank, victim)
        dist.destroy_process_group()
        return
    if victim and moment == "model_load":
        import threading

        threading.Timer(random.Random(plan["seed"]).uniform(0, 0.05), _die, (plan, rank)).start()
    model = apply_tp(_model(plan["seed"]), world, _PLAN, check="off")
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
        _losses(model, 1, world)
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
            )
        except (LaunchFailed, LaunchInterrupted) as err:
            code = print_failure(err)
    if code:
        exit_now(code)  # as `shardkit train` does
    return 0


# --------------------------------------------------------------------------- observer side


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in "ZX" and int(fields[3]) == sid:  # state, ..., session
            out.append(int(name))
    return out


def _start(plan: dict) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p),
    }
    out = open(os.path.join(plan["dir"], "stderr"), "w")
    # A session of its own: every process of the job (grandchildren re-parented to init
    # included) stays findable by its session id; a signal to the launcher reaches it alone.
    return subprocess.Popen(
        [sys.executable, HERE, "_job", json.dumps(plan)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def _wait_for(path_fn, timeout: float, proc: subprocess.Popen) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path_fn():
            return True
        if proc.poll() is not None and not path_fn():
            return False
        time.sleep(0.02)
    return False


def _until_gone(sid: int, proc: subprocess.Popen, limit: float = 60.0) -> tuple[float, float]:
    """Poll until no process of the session lives; the time.time() when the last worker was gone
    and when every process was (``inf`` past ``limit``)."""
    end = time.monotonic() + limit
    workers_gone = float("inf")
    while time.monotonic() < end:
        proc.poll()  # reap the launcher (a zombie otherwise)
        alive = _session_pids(sid)
        if workers_gone == float("inf") and not [p for p in alive if p != proc.pid]:
            workers_gone = time.time()
        if not alive:
            return workers_gone, time.time()
        time.sleep(0.02)
    return workers_gone, float("inf")


def run_fault(scenario: str, seed: int) -> dict:
    """One run of ``scenario`` (an entry of :data:`SCENARIOS`); returns its record."""
    rng = random.Random(seed)
    workdir = tempfile.mkdtemp(prefix="shardkit-fault-")
    plan: dict = {"kind": "fault", "dir": workdir, "seed": seed}
    if scenario.startswith("kill worker: "):
        plan.update(moment=scenario.split(": ")[1], victim=rng.randrange(NPROC))
        if plan["moment"] == "save":
            plan["k"] = 1  # its first file-system operation of the save (rank 1 has few)
    else:
        plan["forever"] = True
    if scenario == STALL:
        plan["timeout"] = STALL_TIMEOUT_S
    proc = _start(plan)
    sid = proc.pid
    killed = os.path.join(workdir, "killed")
    record: dict = {"scenario": scenario, "seed": seed}
    if scenario == STALL:
        record["victim"] = plan["victim"] = rng.randrange(NPROC)
        ready = [os.path.join(workdir, f"ready{r}") for r in range(NPROC)]
        ok = _wait_for(lambda: all(os.path.exists(p) for p in ready), 120, proc)
        if ok:
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the training loop
            t0 = time.time()
            os.kill(int(open(ready[plan["victim"]]).read()), signal.SIGSTOP)
    elif "victim" in plan:
        record["victim"] = plan["victim"]
        ok = _wait_for(lambda: os.path.exists(killed), 120, proc)
        if ok:
            while True:  # the marker is written just before the kill
                try:
                    t0 = json.loads(open(killed).read())["time"]
                    break
                except (ValueError, OSError):
                    time.sleep(0.01)
    else:
        ready = [os.path.join(workdir, f"ready{r}") for r in range(NPROC)]
        ok = _wait_for(lambda: all(os.path.exists(p) for p in ready), 120, proc)
        if ok:
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the training loop
            t0 = time.time()
            os.kill(proc.pid, getattr(signal, scenario.split()[0]))
    if not ok:
        t0 = time.time()
    workers_gone, gone = _until_gone(sid, proc)
    for pid in _session_pids(sid):  # clean up a failed run (never expected)
        os.kill(pid, signal.SIGKILL)
    rc = proc.wait()
    text = open(os.path.join(workdir, "stderr")).read()
    record.update(
        t0=t0,
        gone=gone,
        started=ok,
        rc=rc,
        seconds=round(gone - t0, 3),
        workers_seconds=round(workers_gone - t0, 3),
        output=text[-2000:],
    )
    record.update(
        checks(scenario, plan, rc, gone - t0, text) if ok else {"ok": False, "why": "the fault never happened"}
    )
    subprocess.run(["rm", "-rf", workdir], check=False)
    return record


def limit_s(scenario: str) -> float:
    """Seconds from the fault within which every process of the job must be gone."""
    return STALL_TIMEOUT_S + STALL_MARGIN_S if scenario == STALL else GONE_WITHIN_S


def checks(scenario: str, plan: dict, rc: int, seconds: float, text: str) -> dict:
    """Did the run meet the promise? ``{"ok": bool, "why": str}``."""
    if seconds > limit_s(scenario):
        return {"ok": False, "why": f"processes alive {seconds:.1f} s after the fault"}
    if scenario == STALL:
        suspect = f"rank {plan['victim']} stopped answering first (suspect)"
        ok = rc == 1 and suspect in text and "failed first" not in text
        return {"ok": ok, "why": "" if ok else f"rc {rc} or the stopped rank not named first as the suspect"}
    if scenario.startswith("kill worker"):
        cause = f"rank {plan['victim']} failed first (exit code -9):\nSignal 9 (SIGKILL)"
        if rc != 1 or cause not in text:
            return {"ok": False, "why": f"rc {rc} or root cause not printed"}
        return {"ok": True, "why": ""}
    sig = scenario.split()[0]
    if sig == "SIGKILL":
        return {"ok": rc == -signal.SIGKILL, "why": "" if rc == -signal.SIGKILL else f"rc {rc}"}
    want = 128 + getattr(signal, sig)
    line = f"shardkit: interrupted ({sig}), stopped {NPROC} ranks"
    ok = rc == want and line in text
    return {"ok": ok, "why": "" if ok else f"rc {rc} (want {want}) or no '{line}'"}


def _save_plan(trainer: bool, **kw) -> dict:
    return {"kind": "train", **TRAIN_WINDOW, **kw} if trainer else {"kind": "save", **kw}


def calibrate_save(trainer: bool = False) -> dict:
    """File-system operations and seconds of each rank's second save (the trainer's step-2
    save), unkilled."""
    workdir = tempfile.mkdtemp(prefix="shardkit-savecal-")
    plan = _save_plan(trainer, dir=workdir, seed=0, calibrate=True)
    proc = _start(plan)
    proc.wait()
    try:
        counts = {r: json.loads(open(os.path.join(workdir, f"count{r}")).read()) for r in range(NPROC)}
    except OSError as exc:
        raise RuntimeError(open(os.path.join(workdir, "stderr")).read()) from exc
    subprocess.run(["rm", "-rf", workdir], check=False)
    return counts


def _world_of_one() -> bool:
    """A gloo world of this process alone, unless one exists; True when it was made here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    store = dist.FileStore(tempfile.mktemp(prefix="shardkit-store-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


def verify_save(workdir: str, seed: int) -> dict:
    """After a killed save: the latest save loads bit-exactly, resumes with the same losses, and
    the next save removes the partial directory (in this process, a world of one rank)."""
    import torch.distributed as dist

    made = _world_of_one()
    try:
        return _verify_save(os.path.join(workdir, "ckpt"), seed)
    finally:
        if made:
            dist.destroy_process_group()


def _verify_save(root: str, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from shardkit import load_sharded_checkpoint, save_sharded_checkpoint
    from shardkit.checkpoint import latest_checkpoint

    latest = latest_checkpoint(root)
    version = os.path.basename(latest)
    expected = _model(seed)
    if version == "version_00000002":  # the killed save had already replaced the pointer
        with torch.no_grad():
            for p in expected.parameters():
                p.add_(1.0)
    elif version != "version_00000001":
        return {"ok": False, "why": f"latest is {version}"}
    loaded = _model(seed + 1)  # other weights, overwritten by the load
    load_sharded_checkpoint(loaded, root, dist.group.WORLD)
    exact = all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), expected.state_dict().values()))
    same_losses = _losses(loaded, 3) == _losses(expected, 3)
    partial = sorted(n for n in os.listdir(root) if n.startswith("version_") and os.path.join(root, n) != latest)
    save_sharded_checkpoint(loaded, root, dist.group.WORLD)
    left = sorted(os.listdir(root))
    cleaned = len(left) == 2 and left[0] == "latest"
    ok = exact and same_losses and cleaned
    return {
        "ok": ok,
        "latest": version,
        "latest_is": "new" if version == "version_00000002" else "previous",
        "partial_before": partial,
        "exact": exact,
        "same_losses": same_losses,
        "cleaned": cleaned,
        "why": "" if ok else f"exact {exact}, losses {same_losses}, left {left}",
    }


_UNINTERRUPTED: list = []  # the trainer's losses without a kill, computed once per process


def verify_train(workdir: str) -> dict:
    """After a killed trainer save: the latest checkpoint is step 1 or 2, and ``--resume`` (here,
    one rank: another layout) continues with the uninterrupted run's losses and leaves only
    complete saves."""
    import torch.distributed as dist

    made = _world_of_one()
    try:
        return _verify_train(os.path.join(workdir, "ckpt"))
    finally:
        if made:
            dist.destroy_process_group()


def _verify_train(root: str) -> dict:
    import torch

    from shardkit.checkpoint import MANIFEST, latest_checkpoint
    from shardkit.train.run import train

    def run(**kw) -> dict:
        result = train(_train_cfg(1, tp=1, **kw), "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        assert result is not None  # rank 0 of a world of one
        return result

    if not _UNINTERRUPTED:
        _UNINTERRUPTED.append(run(save_every=0)["losses"])
    full = _UNINTERRUPTED[0]
    latest = latest_checkpoint(root)
    version = os.path.basename(latest) if latest else None
    if version not in ("step_00000001", "step_00000002"):
        return {"ok": False, "latest": version, "why": f"latest is {version}"}
    resumed = run(checkpoint_dir=root, resume=True)
    start, losses = resumed.get("first_step"), resumed["losses"]
    same_losses = (
        start == int(version[5:])
        and len(losses) == len(full) - start
        and all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(losses, full[start:]))
    )
    left = sorted(os.listdir(root))
    cleaned = all(n == "latest" or os.path.exists(os.path.join(root, n, MANIFEST)) for n in left)
    ok = same_losses and cleaned
    return {
        "ok": ok,
        "latest": version,
        "latest_is": "new" if version == "step_00000002" else "previous",
        "exact": True,
        "same_losses": same_losses,
        "cleaned": cleaned,
        "why": "" if ok else f"resumed at {start}: {losses} vs {full}; left {left}",
    }


def run_save(seed: int, counts: dict, target: str | None = None, k: int | None = None, trainer: bool = False) -> dict:
    """One kill-during-save run; ``counts`` from :func:`calibrate_save`. ``target`` ("rank 0",
    "rank 1", "whole job") and ``k`` (the victim's file-system operation to die before) are
    drawn from ``seed`` unless given. ``trainer``: kill the trainer's step-2 save (always before
    a file-system operation: a delay could not aim at that save)."""
    rng = random.Random(seed)
    workdir = tempfile.mkdtemp(prefix="shardkit-savekill-")
    target = target or rng.choice(["rank 0", "rank 1", "whole job"])
    victim = 0 if target != "rank 1" else 1
    plan = _save_plan(trainer, dir=workdir, seed=seed, victim=victim, whole_job=target == "whole job")
    if k is not None or trainer or rng.random() < 0.5:
        plan["k"] = k or rng.randint(1, counts[victim]["events"])
        how = f"before file-system operation {plan['k']} of {counts.get(victim, {}).get('events', '?')}"
    else:
        plan["delay"] = round(rng.uniform(0, 1.2 * counts[victim]["seconds"]), 4)
        how = f"after {plan['delay']} s of a ~{counts[victim]['seconds']:.2f} s save"
    proc = _start(plan)
    sid = proc.pid
    _until_gone(sid, proc)
    rc = proc.wait()
    record = {
        "seed": seed,
        "target": target,
        "how": how,
        "rc": rc,
        "killed": os.path.exists(os.path.join(workdir, "killed")),
    }
    if not os.path.isdir(os.path.join(workdir, "ckpt")):
        record.update(ok=False, why="no checkpoint at all: " + open(os.path.join(workdir, "stderr")).read()[-1500:])
    else:
        record.update(verify_train(workdir) if trainer else verify_save(workdir, seed))
    subprocess.run(["rm", "-rf", workdir], check=False)
    return record


WRITER_STEPS = 6


def _cli_job_b(root: str) -> subprocess.CompletedProcess:
    """B through ``shardkit train`` on A's directory (the same small job)."""
    argv = [
        "train",
        "--nproc",
        str(NPROC),
        "--tp",
        str(NPROC),
        "--steps",
        str(WRITER_STEPS),
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--dtype",
        "float64",
        "--layers",
        "2",
        "--save-every",
        "1",
        "--no-verify",
        "--checkpoint-dir",
        root,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def run_writers(seed: int) -> dict:
    """One ``writers`` run: A running, B started twice on its directory; see the module doc."""
    workdir = tempfile.mkdtemp(prefix="shardkit-writers-")
    root = os.path.join(workdir, "ckpt")
    a_dir, b_dir = os.path.join(workdir, "a"), os.path.join(workdir, "b")
    os.makedirs(a_dir)
    os.makedirs(b_dir)
    go_on = os.path.join(workdir, "go_on")
    a = _start({"kind": "train", "dir": a_dir, "ckpt": root, "seed": seed, "steps": WRITER_STEPS, "go_on": go_on})
    record: dict = {"seed": seed}
    started = _wait_for(lambda: os.path.exists(os.path.join(root, "latest")), 120, a)  # A saved step 1
    holder = {}
    if started:
        try:
            with open(os.path.join(root, ".lock")) as f:
                holder = json.load(f)
        except FileNotFoundError:
            pass  # no lock (shardkit before issue 19): B must still not get through
        past = _start(
            {"kind": "train", "dir": b_dir, "ckpt": root, "seed": seed, "steps": WRITER_STEPS, "past_validation": True}
        )
        cli = _cli_job_b(root)
        past_rc = past.wait(timeout=300)
        past_text = open(os.path.join(b_dir, "stderr")).read()
        still_running = a.poll() is None
    open(go_on, "w").close()
    a_rc = a.wait(timeout=300)
    if not started:
        record.update(ok=False, why="A never saved: " + open(os.path.join(a_dir, "stderr")).read()[-1500:])
        subprocess.run(["rm", "-rf", workdir], check=False)
        return record
    named = f"run {holder.get('run_id')} (pid {holder.get('pid')} on host {holder.get('host')})"
    cli_refused = cli.returncode == 2 and f"is in use by {named}" in cli.stderr
    past_refused = past_rc != 0 and f"is in use by {named}" in past_text
    record.update(
        cli_rc=cli.returncode,
        past_rc=past_rc,
        a_rc=a_rc,
        a_running_after_b=still_running,
        cli_refused=cli_refused,
        past_refused=past_refused,
    )
    record.update(_verify_writers(root))
    ok = cli_refused and past_refused and still_running and a_rc == 0 and record["saves_ok"]
    record.update(
        ok=ok,
        why=""
        if ok
        else f"B: {cli.stderr[-600:]} / {past_text[-600:]}; A rc {a_rc}: "
        + open(os.path.join(a_dir, "stderr")).read()[-600:],
    )
    subprocess.run(["rm", "-rf", workdir], check=False)
    return record


def _verify_writers(root: str) -> dict:
    """A's saves after B's attempts: all complete, ``latest`` its last, and it resumes."""
    import torch
    import torch.distributed as dist

    from shardkit.checkpoint import MANIFEST, latest_checkpoint
    from shardkit.train.run import train

    names = sorted(n for n in os.listdir(root) if not n.startswith("."))
    expected = ["latest"] + [f"step_{s:08d}" for s in range(1, WRITER_STEPS + 1)]
    complete = names == expected and all(os.path.isfile(os.path.join(root, n, MANIFEST)) for n in expected[1:])
    latest = latest_checkpoint(root)
    made = _world_of_one()
    try:
        result = train(
            _train_cfg(1, tp=1, checkpoint_dir=root, resume=True, steps=WRITER_STEPS + 1),
            "gloo",
            torch.device("cpu"),
            time.perf_counter(),
            progress=False,
        )
    finally:
        if made:
            dist.destroy_process_group()
    resumed = result is not None and result["first_step"] == WRITER_STEPS
    return {
        "saves": names,
        "latest": os.path.basename(latest) if latest else None,
        "resumed": resumed,
        "saves_ok": complete and latest is not None and latest.endswith(expected[-1]) and resumed,
    }


# --------------------------------------------------------------------------- main


def _table(rows: list[tuple], header: tuple) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=("launcher", "save", "writers"))
    parser.add_argument(
        "--runs", type=int, default=None, help="runs per scenario (launcher 20) or in all (save 50, save --trainer 10)"
    )
    parser.add_argument("--trainer", action="store_true", help="save: kill the trainer's own save and --resume")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="launcher: only these scenarios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write every run's record here")
    args = parser.parse_args(argv)
    records = []
    if args.family == "writers":
        records = [run_writers(args.seed * 1000 + i) for i in range(args.runs or 3)]
        for r in records:
            if not r["ok"]:
                print(f"  FAILED seed {r['seed']}: {r['why']}", flush=True)
        counts = [sum(r.get(k, False) for r in records) for k in ("cli_refused", "past_refused", "saves_ok", "ok")]
        print(
            _table(
                [("two jobs on one --checkpoint-dir", len(records), *counts)],
                (
                    "scenario",
                    "runs",
                    "B refused before launch",
                    "B refused by the lock",
                    "A's saves complete, resumed",
                    "passed",
                ),
            )
        )
    elif args.family == "launcher":
        runs = args.runs or 20
        rows = []
        for scenario in args.scenario or SCENARIOS:
            res = [run_fault(scenario, args.seed * 1000 + i) for i in range(runs)]
            records += res
            good = [r for r in res if r["ok"]]
            worst = max((r["seconds"] for r in res if r["started"]), default=float("nan"))
            rows.append((scenario, len(res), len(good), f"{worst:.2f}", sorted({r["rc"] for r in res})))
            print(_table(rows[-1:], ("scenario", "runs", "passed", "max s to all gone", "exit codes")), flush=True)
            for r in res:
                if not r["ok"]:
                    print(f"  FAILED seed {r['seed']}: {r['why']}\n{r['output']}", flush=True)
        print(_table(rows, ("scenario", "runs", "passed", "max s to all gone", "exit codes")))
    else:
        runs = args.runs or (10 if args.trainer else 50)
        counts = calibrate_save(args.trainer)
        print(f"calibration: file-system operations and seconds of the killed save per rank: {counts}", flush=True)
        for i in range(runs):
            r = run_save(args.seed * 1000 + i, counts, trainer=args.trainer)
            records.append(r)
            print(f"run {i}: {r['target']} {r['how']}: latest {r.get('latest')} ok={r['ok']} {r['why']}", flush=True)
        rows = []
        for target in ("rank 0", "rank 1", "whole job"):
            sub = [r for r in records if r["target"] == target]
            rows.append(
                (
                    target,
                    len(sub),
                    sum(r["killed"] for r in sub),
                    sum(r.get("latest_is") == "previous" for r in sub),
                    sum(r.get("latest_is") == "new" for r in sub),
                    sum(r["ok"] for r in sub),
                )
            )
        print(
            _table(
                rows,
                (
                    "killed",
                    "runs",
                    "kill happened",
                    "latest = previous save",
                    "latest = new save",
                    "resumed with the same losses, partial cleaned"
                    if args.trainer
                    else "loaded bit-exactly, same losses, partial cleaned",
                ),
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_job":
        sys.exit(job(json.loads(sys.argv[2])))
    sys.exit(main())
