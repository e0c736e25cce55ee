"""What both sides of a fault trial share: the trial job's size and model, the trainer run it
kills, and the observer's process helpers (a job's processes, waiting for a file, a world of one)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
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


# The trainer trials' text: one 90 KB file (torch's functional module), not the default corpus
# (31 MB that rank 0 reads and broadcasts in every run): the trials' claims are about kills and saves.
CORPUS = os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin or ""), "functional.py")
# The trainer trials: a small float64 run saving every step; the step-2 save is the one killed.
TRAIN = dict(
    model="llama",
    steps=3,
    seq_len=16,
    batch_size=4,
    dtype="float64",
    layers=2,
    lr=1e-3,
    save_every=1,
    verify=False,
    data=CORPUS,
)
TRAIN_WINDOW = {"after": "step_00000002", "until": "step_00000003"}


def train_cfg(nproc: int, **kw):
    from shardkit.train.config import TrainConfig, validate_config

    return validate_config(TrainConfig(**{**TRAIN, "nproc": nproc, **kw}), world_size=nproc)


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """``(state, ppid, session, start time in clock ticks)`` of ``pid``, from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _proc_table() -> dict[int, tuple[str, int, int, int]]:
    """Every process's :func:`_stat`."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            out[int(name)] = st
    return out


def _children_table(pids) -> dict[int, tuple[str, int, int, int]]:
    """:func:`_stat` of ``pids`` and of their children (``/proc/PID/task/TID/children``, every
    thread's), found again from each new child: reading a few files, not every process's."""
    out: dict[int, tuple[str, int, int, int]] = {}
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in out or (st := _stat(pid)) is None:
            continue
        out[pid] = st
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                continue
    return out


class JobTree:
    """Every process a trial job ever had, followed from its start: the members of its session
    and every descendant of a member. The launcher's forkserver and ranks lead sessions of their
    own (``setsid``, as torchrun's ranks do), so the session alone misses them; a rank orphaned
    by the fault is re-parented to init, so it is recorded while its parent still lives (a thread
    polls every 20 ms). A process is known by ``(pid, start time)``: a reused pid is not the job's.

    A poll reads the known processes' children (a few files); every :data:`FULL_EVERY`-th poll,
    and before the job is declared gone, it reads every process of the machine (a session member
    that no known process parented). Reading all of /proc every 20 ms cost the observer half a
    core on a busy machine (5 ms per read of 170 processes), which the trials then measured.
    """

    FULL_EVERY = 25  # a full read of /proc every 0.5 s

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self._known: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        polls = 0
        while not self._stop.wait(0.02):
            polls += 1
            self.live(full=polls % self.FULL_EVERY == 0)

    def live(self, full: bool = True) -> list[int]:
        """Record the job's new processes; its live (not zombie) ones. ``full``: read every
        process (else the known ones' children only)."""
        with self._lock:
            seeds = {pid for pid, _ in self._known} | {self.sid}
            table = _proc_table() if full else _children_table(seeds)
            known = {pid for pid, start in self._known if table.get(pid, ("X", 0, 0, -1))[3] == start}
            grown = True
            while grown:  # a process of the session, or a child of a known one (to any depth)
                grown = False
                for pid, (_, ppid, sid, start) in table.items():
                    if pid not in known and (sid == self.sid or ppid in known):
                        known.add(pid)
                        self._known.add((pid, start))
                        grown = True
            return [pid for pid in known if table.get(pid, ("X",))[0] not in "ZX"]

    @property
    def seen(self) -> int:
        """How many processes the job has had (the launcher, its forkserver, the ranks)."""
        with self._lock:
            return len(self._known)

    def close(self) -> None:
        """Stop following the job."""
        self._stop.set()
        self._thread.join()


def start_job(plan: dict) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p),
    }
    out = open(os.path.join(plan["dir"], "stderr"), "w")
    # A session of its own: a signal to the launcher reaches it alone, and the job's processes
    # are findable from it (JobTree, attached as ``proc.tree``).
    proc = subprocess.Popen(
        [sys.executable, HERE, "_job", json.dumps(plan)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    proc.tree = JobTree(proc.pid)  # type: ignore[attr-defined]
    return proc


def wait_for(path_fn, timeout: float, proc: subprocess.Popen) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path_fn():
            return True
        if proc.poll() is not None and not path_fn():
            return False
        time.sleep(0.02)
    return False


def until_gone(proc: subprocess.Popen, limit: float = 60.0) -> tuple[float, float]:
    """Poll until no process of the job (``proc.tree``, :class:`JobTree`) lives; the time.time()
    when the last worker was gone and when every process was (``inf`` past ``limit``)."""
    end = time.monotonic() + limit
    workers_gone = float("inf")
    while time.monotonic() < end:
        proc.poll()  # reap the launcher (a zombie otherwise)
        alive = proc.tree.live(full=False)  # type: ignore[attr-defined]
        if workers_gone == float("inf") and not [p for p in alive if p != proc.pid]:
            workers_gone = time.time()
        if not alive and not proc.tree.live():  # type: ignore[attr-defined]  # confirmed by a full read
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
