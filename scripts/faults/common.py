"""What both sides of a fault trial share: the trial job's size and model, the trainer run it
kills, and the observer's process helpers (a job's session, waiting for a file, a world of one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

NPROC = 2
# The entry point every trial job runs (``fault_trials.py _job PLAN``): its directory holds this package.
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fault_trials.py")


def trial_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 32))


TP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise"}


def sgd_losses(model, steps: int, world=None) -> list[float]:
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


# The trainer trials: a small float64 run saving every step; the step-2 save is the one killed.
TRAIN = dict(
    model="llama", steps=3, seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3, save_every=1, verify=False
)
TRAIN_WINDOW = {"after": "step_00000002", "until": "step_00000003"}


def train_cfg(nproc: int, **kw):
    from shardkit.train.config import TrainConfig, validate_config

    return validate_config(TrainConfig(**{**TRAIN, "nproc": nproc, **kw}), world_size=nproc)


def session_pids(sid: int) -> list[int]:
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


def start_job(plan: dict) -> subprocess.Popen:
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


def wait_for(path_fn, timeout: float, proc: subprocess.Popen) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path_fn():
            return True
        if proc.poll() is not None and not path_fn():
            return False
        time.sleep(0.02)
    return False


def until_gone(sid: int, proc: subprocess.Popen, limit: float = 60.0) -> tuple[float, float]:
    """Poll until no process of the session lives; the time.time() when the last worker was gone
    and when every process was (``inf`` past ``limit``)."""
    end = time.monotonic() + limit
    workers_gone = float("inf")
    while time.monotonic() < end:
        proc.poll()  # reap the launcher (a zombie otherwise)
        alive = session_pids(sid)
        if workers_gone == float("inf") and not [p for p in alive if p != proc.pid]:
            workers_gone = time.time()
        if not alive:
            return workers_gone, time.time()
        time.sleep(0.02)
    return workers_gone, float("inf")


def world_of_one() -> bool:
    """A gloo world of this process alone, unless one exists; True when it was made here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    store = dist.FileStore(tempfile.mktemp(prefix="shardkit-store-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


def table(rows: list[tuple], header: tuple) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
