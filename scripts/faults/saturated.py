"""``fault_trials.py saturated``: ``shardkit train --tokenizer DIR --tp 2 --steps 10 --save-hf OUT``
on a CPU saturated by busy processes (issue 31, finding 1).

At load ~80 the old launcher's watchdog killed rank 0 during its solo work after the other ranks
had exited (the gather, ``save_pretrained``, the tokenizer): its heartbeat thread missed beats for
more than a 5 s grace, no model was written and the user read ``rank 0 failed first (exit code
-9)``. Here ``busy`` processes (``while True: pass``, normal priority: they compete for the CPU,
they are not niced away) raise the 1-minute load average above ``min_load`` before the command
starts and keep it there until it ends. A run passes when the command exits 0, the Hugging Face
directory holds a model and its tokenizer, and no watchdog line was printed.

:func:`starve_rank0` is the deterministic half (``tests/cli/test_saturated_save_hf.py`` uses it):
SIGSTOP / SIGCONT slices on rank 0 while the ranks run, and once another rank has left, rank 0
held stopped for ``hold_s`` seconds in its solo phase, longer than the old grace.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from shardkit.train.liveness import read_heartbeats

from .common import table

BUSY_CODE = "while True:\n    pass\n"
# the files a --save-hf directory of the built-in llama with a tokenizer holds (weights: one file,
# or an index of shards)
HF_FILES = ("config.json", "tokenizer.json")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on the CPU (each in its own session, so a stray one is findable)."""
    return [
        subprocess.Popen([sys.executable, "-c", BUSY_CODE], stdout=subprocess.DEVNULL, start_new_session=True)
        for _ in range(n)
    ]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def wait_for_load(min_load: float, limit_s: float) -> float:
    """Poll the 1-minute load average every second until it reaches ``min_load`` (at most
    ``limit_s`` seconds); the last value read."""
    end = time.monotonic() + limit_s
    load = os.getloadavg()[0]
    while load < min_load and time.monotonic() < end:
        time.sleep(1.0)
        load = os.getloadavg()[0]
    return load


def train_argv(tokenizer: str, data: str, out: str, steps: int, nproc: int | None, timeout: float | None) -> list[str]:
    """Finding 1's command (``--data`` one file: the tokenizer encodes it, not the standard library)."""
    argv = [sys.executable, "-m", "shardkit", "train", "--tokenizer", tokenizer, "--data", data, "--tp", "2"]
    argv += ["--steps", str(steps), "--save-hf", out]
    argv += ["--nproc", str(nproc)] if nproc is not None else []
    argv += ["--timeout", f"{timeout:g}"] if timeout is not None else []
    return argv


def hf_written(out: str) -> bool:
    """``out`` holds a Hugging Face model: its config, its weights and the run's tokenizer."""
    names = set(os.listdir(out)) if os.path.isdir(out) else set()
    return all(n in names for n in HF_FILES) and any(n in names for n in WEIGHTS)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def starve_rank0(flight: str, proc: subprocess.Popen, nproc: int, hold_s: float, slice_s: float = 0.1) -> dict:
    """While the job ``proc`` runs: once every rank beat into ``flight``, rank 0 runs in slices
    (``slice_s`` running, ``slice_s`` stopped); as soon as another rank has left (its beat says
    ``exiting``, or its process is gone) while rank 0 is stopped, rank 0 stays stopped ``hold_s``
    seconds, then runs freely. Only the heartbeat's pid and ``exiting`` are read (files of every
    release have them). Returns ``{"held_s": seconds rank 0 was held alone (0: never), "rank0_pid"}``
    (an old launcher kills rank 0 during the hold: the job's exit code and output say so).
    """
    beats: dict = {}
    while proc.poll() is None and not all(r in beats for r in range(nproc)):
        time.sleep(0.05)
        beats = read_heartbeats(flight)
    if proc.poll() is not None:
        return {"held_s": 0.0, "rank0_pid": None}
    pid = beats[0].pid
    held = 0.0
    try:
        while proc.poll() is None and _pid_alive(pid):
            _signal(pid, signal.SIGSTOP)
            beats = read_heartbeats(flight)
            if any(b.exiting or not _pid_alive(b.pid) for r, b in beats.items() if r != 0):
                start = time.monotonic()
                time.sleep(hold_s)  # rank 0 alone, silent: longer than the old 5 s grace
                held = time.monotonic() - start
                break
            time.sleep(slice_s)
            _signal(pid, signal.SIGCONT)
            time.sleep(slice_s)
    finally:
        _signal(pid, signal.SIGCONT)
    return {"held_s": round(held, 1), "rank0_pid": pid}


def run_saturated(
    tokenizer: str, data: str, busy: int, min_load: float, steps: int, nproc: int | None, limit_s: float = 1800.0
) -> dict:
    """One run of finding 1's command after ``busy`` spinning processes raised the load to
    ``min_load`` (waiting at most 600 s); its record (load while it ran, rc, seconds, the model)."""
    workdir = tempfile.mkdtemp(prefix="shardkit-saturated-")
    out, log = os.path.join(workdir, "hf"), os.path.join(workdir, "output")
    procs = start_busy(busy)
    loads: list[float] = []
    try:
        at_start = wait_for_load(min_load, 600.0)
        start = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(
                train_argv(tokenizer, data, out, steps, nproc, None), stdout=f, stderr=subprocess.STDOUT
            )
            while proc.poll() is None and time.monotonic() - start < limit_s:
                loads.append(os.getloadavg()[0])
                time.sleep(1.0)
            if proc.poll() is None:
                proc.kill()
            rc = proc.wait()
        seconds = time.monotonic() - start
    finally:
        stop_busy(procs)
    text = open(log).read()
    record = {
        "busy": busy,
        "load_at_start": round(at_start, 1),
        "load_min": round(min(loads, default=at_start), 1),
        "load_median": round(statistics.median(loads) if loads else at_start, 1),
        "load_max": round(max(loads, default=at_start), 1),
        "rc": rc,
        "seconds": round(seconds, 1),
        "written": hf_written(out),
        "watchdog": "shardkit's watchdog" in text,
        "output": text[-3000:],
    }
    record["ok"] = record["rc"] == 0 and record["written"] and not record["watchdog"]
    subprocess.run(["rm", "-rf", workdir], check=False)
    return record


def main(runs: int, tokenizer: str, data: str, busy: int, min_load: float, steps: int, nproc: int | None) -> list[dict]:
    """``runs`` saturated runs; prints each record's numbers, the failures' output and a table."""
    records = []
    for _ in range(runs):
        r = run_saturated(tokenizer, data, busy, min_load, steps, nproc)
        records.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "output"}), flush=True)
        if not r["ok"]:
            print(f"  FAILED:\n{r['output']}", flush=True)
    header = ("command", "busy", "runs", "passed", "load while it ran (min / median / max)", "seconds", "exit codes")
    loads = "; ".join(f"{r['load_min']} / {r['load_median']} / {r['load_max']}" for r in records)
    row = (
        f"train --tp 2 --steps {steps} --save-hf",
        busy,
        len(records),
        sum(r["ok"] for r in records),
        loads,
        ", ".join(str(r["seconds"]) for r in records),
        sorted({r["rc"] for r in records}),
    )
    print(table([row], header))
    return records
