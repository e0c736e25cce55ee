"""``fault_trials.py save [--trainer]``: SIGKILL a save half-way (a rank or the whole job), then
check in this process that the latest save loads, resumes with the same losses and is cleaned up."""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time

from .common import NPROC, TRAIN_WINDOW, sgd_losses, start_job, table, train_cfg, trial_model, until_gone, world_of_one


def _save_plan(trainer: bool, **kw) -> dict:
    return {"kind": "train", **TRAIN_WINDOW, **kw} if trainer else {"kind": "save", **kw}


def calibrate_save(trainer: bool = False) -> dict:
    """File-system operations and seconds of each rank's second save (the trainer's step-2
    save), unkilled."""
    workdir = tempfile.mkdtemp(prefix="shardkit-savecal-")
    plan = _save_plan(trainer, dir=workdir, seed=0, calibrate=True)
    proc = start_job(plan)
    proc.wait()
    try:
        counts = {r: json.loads(open(os.path.join(workdir, f"count{r}")).read()) for r in range(NPROC)}
    except OSError as exc:
        raise RuntimeError(open(os.path.join(workdir, "stderr")).read()) from exc
    subprocess.run(["rm", "-rf", workdir], check=False)
    return counts


def verify_save(workdir: str, seed: int) -> dict:
    """After a killed save: the latest save loads bit-exactly, resumes with the same losses, and
    the next save removes the partial directory (in this process, a world of one rank)."""
    import torch.distributed as dist

    made = world_of_one()
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
    expected = trial_model(seed)
    if version == "version_00000002":  # the killed save had already replaced the pointer
        with torch.no_grad():
            for p in expected.parameters():
                p.add_(1.0)
    elif version != "version_00000001":
        return {"ok": False, "why": f"latest is {version}"}
    loaded = trial_model(seed + 1)  # other weights, overwritten by the load
    load_sharded_checkpoint(loaded, root, dist.group.WORLD)
    exact = all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), expected.state_dict().values()))
    same_losses = sgd_losses(loaded, 3) == sgd_losses(expected, 3)
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


def _train_here(**kw) -> dict:
    """The trial's trainer run in this process (rank 0 of a world of one): its result."""
    import torch

    from shardkit.train.run import train

    result = train(train_cfg(1, tp=1, **kw), "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    assert result is not None  # rank 0 of a world of one
    return result


_UNINTERRUPTED: list[float] = []


def uninterrupted_losses() -> list[float]:
    """The trainer trial's per-step losses without a kill (one rank, no saves); computed once per
    process (every trainer trial compares with the same run)."""
    import torch.distributed as dist

    if not _UNINTERRUPTED:
        made = world_of_one()
        try:
            _UNINTERRUPTED.extend(_train_here(save_every=0)["losses"])
        finally:
            if made:
                dist.destroy_process_group()
    return list(_UNINTERRUPTED)


def verify_train(workdir: str, full: list[float]) -> dict:
    """After a killed trainer save: the latest checkpoint is step 1 or 2, and ``--resume`` (here,
    one rank: another layout) continues with the uninterrupted run's losses ``full`` and leaves
    only complete saves."""
    import torch.distributed as dist

    made = world_of_one()
    try:
        return _verify_train(os.path.join(workdir, "ckpt"), full)
    finally:
        if made:
            dist.destroy_process_group()


def _verify_train(root: str, full: list[float]) -> dict:
    from shardkit.checkpoint import MANIFEST, latest_checkpoint

    latest = latest_checkpoint(root)
    version = os.path.basename(latest) if latest else None
    if version not in ("step_00000001", "step_00000002"):
        return {"ok": False, "latest": version, "why": f"latest is {version}"}
    resumed = _train_here(checkpoint_dir=root, resume=True)
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


def run_save(
    seed: int,
    counts: dict,
    target: str | None = None,
    k: int | None = None,
    trainer: bool = False,
    full: list[float] | None = None,
    asynchronous: bool = False,
) -> dict:
    """One kill-during-save run; ``counts`` from :func:`calibrate_save`. ``target`` ("rank 0",
    "rank 1", "whole job") and ``k`` (the victim's file-system operation to die before) are
    drawn from ``seed`` unless given. ``trainer``: kill the trainer's step-2 save (always before
    a file-system operation: a delay could not aim at that save); ``full``: the uninterrupted
    run's losses (:func:`uninterrupted_losses`, computed here when not given); ``asynchronous``:
    the trainer saves with ``--async-checkpoint`` (``killed_thread`` says which thread died)."""
    rng = random.Random(seed)
    workdir = tempfile.mkdtemp(prefix="shardkit-savekill-")
    target = target or rng.choice(["rank 0", "rank 1", "whole job"])
    victim = 0 if target != "rank 1" else 1
    plan = _save_plan(trainer, dir=workdir, seed=seed, victim=victim, whole_job=target == "whole job")
    plan["async"] = asynchronous
    if k is not None or trainer or rng.random() < 0.5:
        plan["k"] = k or rng.randint(1, counts[victim]["events"])
        how = f"before file-system operation {plan['k']} of {counts.get(victim, {}).get('events', '?')}"
    else:
        plan["delay"] = round(rng.uniform(0, 1.2 * counts[victim]["seconds"]), 4)
        how = f"after {plan['delay']} s of a ~{counts[victim]['seconds']:.2f} s save"
    proc = start_job(plan)
    until_gone(proc)
    proc.tree.close()  # type: ignore[attr-defined]
    rc = proc.wait()
    record = {
        "seed": seed,
        "target": target,
        "how": how,
        "rc": rc,
        "killed": os.path.exists(os.path.join(workdir, "killed")),
    }
    if record["killed"]:
        with open(os.path.join(workdir, "killed")) as f:
            record["killed_thread"] = json.loads(f.read() or "{}").get("thread")
    if not os.path.isdir(os.path.join(workdir, "ckpt")):
        record.update(ok=False, why="no checkpoint at all: " + open(os.path.join(workdir, "stderr")).read()[-1500:])
    else:
        full = full if full is not None or not trainer else uninterrupted_losses()
        record.update(verify_train(workdir, full or []) if trainer else verify_save(workdir, seed))
    subprocess.run(["rm", "-rf", workdir], check=False)
    return record


def main(runs: int, trainer: bool, seed: int) -> list[dict]:
    """``runs`` kill-during-save runs after a calibration; prints each and a table; the records."""
    counts = calibrate_save(trainer)
    print(f"calibration: file-system operations and seconds of the killed save per rank: {counts}", flush=True)
    full = uninterrupted_losses() if trainer else None
    records = []
    for i in range(runs):
        r = run_save(seed * 1000 + i, counts, trainer=trainer, full=full)
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
    passed = (
        "resumed with the same losses, partial cleaned"
        if trainer
        else "loaded bit-exactly, same losses, partial cleaned"
    )
    print(table(rows, ("killed", "runs", "kill happened", "latest = previous save", "latest = new save", passed)))
    return records
