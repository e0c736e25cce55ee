"""``fault_trials.py writers``: two jobs on one ``--checkpoint-dir``; the second is refused, the
first's saves stay whole and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from .common import CORPUS, HERE, NPROC, start_job, table, train_cfg, wait_for, world_of_one

WRITER_STEPS = 3  # A saves step 1, holds while both B are refused, then saves steps 2 and 3


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
        "--data",
        CORPUS,
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
    a = start_job({"kind": "train", "dir": a_dir, "ckpt": root, "seed": seed, "steps": WRITER_STEPS, "go_on": go_on})
    record: dict = {"seed": seed}
    started = wait_for(lambda: os.path.exists(os.path.join(root, "latest")), 120, a)  # A saved step 1
    holder = {}
    if started:
        try:
            with open(os.path.join(root, ".lock")) as f:
                holder = json.load(f)
        except FileNotFoundError:
            pass  # no lock (shardkit before issue 19): B must still not get through
        past = start_job(
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
    made = world_of_one()
    try:
        result = train(
            train_cfg(1, tp=1, checkpoint_dir=root, resume=True, steps=WRITER_STEPS + 1),
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


def main(runs: int, seed: int) -> list[dict]:
    """``runs`` writers runs; prints the failures and a table; the records."""
    records = [run_writers(seed * 1000 + i) for i in range(runs)]
    for r in records:
        if not r["ok"]:
            print(f"  FAILED seed {r['seed']}: {r['why']}", flush=True)
    counts = [sum(r.get(k, False) for r in records) for k in ("cli_refused", "past_refused", "saves_ok", "ok")]
    header = (
        "scenario",
        "runs",
        "B refused before launch",
        "B refused by the lock",
        "A's saves complete, resumed",
        "passed",
    )
    print(table([("two jobs on one --checkpoint-dir", len(records), *counts)], header))
    return records
