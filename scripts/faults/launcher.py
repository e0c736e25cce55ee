"""``fault_trials.py launcher``: SIGKILL a worker at chosen moments, signal the launcher, SIGSTOP a
worker; every process of the job must be gone in time, with the right exit code and root cause."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import time

from .common import NPROC, start_job, table, until_gone, wait_for

GONE_WITHIN_S = 5.0
WORKER_MOMENTS = ("before_init", "model_load", "collective", "save", "end")
LAUNCHER_SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL")
STALL = "SIGSTOP worker"
SCENARIOS = (
    tuple(f"kill worker: {m}" for m in WORKER_MOMENTS) + tuple(f"{s} launcher" for s in LAUNCHER_SIGNALS) + (STALL,)
)
# The stall scenario: the ranks' process-group timeout, and how long after it the job may take to end.
STALL_TIMEOUT_S = 5.0
STALL_MARGIN_S = 30.0


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
    proc = start_job(plan)
    killed = os.path.join(workdir, "killed")
    record: dict = {"scenario": scenario, "seed": seed}
    if scenario == STALL:
        record["victim"] = plan["victim"] = rng.randrange(NPROC)
        ready = [os.path.join(workdir, f"ready{r}") for r in range(NPROC)]
        ok = wait_for(lambda: all(os.path.exists(p) for p in ready), 120, proc)
        if ok:
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the training loop
            t0 = time.time()
            os.kill(int(open(ready[plan["victim"]]).read()), signal.SIGSTOP)
    elif "victim" in plan:
        record["victim"] = plan["victim"]
        ok = wait_for(lambda: os.path.exists(killed), 120, proc)
        if ok:
            while True:  # the marker is written just before the kill
                try:
                    t0 = json.loads(open(killed).read())["time"]
                    break
                except (ValueError, OSError):
                    time.sleep(0.01)
    else:
        ready = [os.path.join(workdir, f"ready{r}") for r in range(NPROC)]
        ok = wait_for(lambda: all(os.path.exists(p) for p in ready), 120, proc)
        if ok:
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the training loop
            t0 = time.time()
            os.kill(proc.pid, getattr(signal, scenario.split()[0]))
    if not ok:
        t0 = time.time()
    workers_gone, gone = until_gone(proc)
    for pid in proc.tree.live():  # type: ignore[attr-defined]  # clean up a failed run (never expected)
        os.kill(pid, signal.SIGKILL)
    proc.tree.close()  # type: ignore[attr-defined]
    rc = proc.wait()
    seen = proc.tree.seen  # type: ignore[attr-defined]
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
        checks(scenario, plan, rc, gone - t0, text, seen) if ok else {"ok": False, "why": "the fault never happened"}
    )
    subprocess.run(["rm", "-rf", workdir], check=False)
    return record


def limit_s(scenario: str) -> float:
    """Seconds from the fault within which every process of the job must be gone."""
    return STALL_TIMEOUT_S + STALL_MARGIN_S if scenario == STALL else GONE_WITHIN_S


def checks(scenario: str, plan: dict, rc: int, seconds: float, text: str, seen: int) -> dict:
    """Did the run meet the promise? ``{"ok": bool, "why": str}``; ``seen``: the job's processes
    the observer followed (fewer than the launcher and its ranks: "all gone" would prove nothing)."""
    if seen < NPROC + 1:
        return {"ok": False, "why": f"the observer followed {seen} processes, not the launcher and {NPROC} ranks"}
    if seconds > limit_s(scenario):
        return {"ok": False, "why": f"processes alive {seconds:.1f} s after the fault"}
    if scenario == STALL:
        # the watchdog stops the silent rank and says so; after the process-group timeout the
        # launcher's diagnosis names it as the suspect: either names the victim, never another rank
        v = plan["victim"]
        stopped = "shardkit's watchdog stopped rank {}:"
        named = f"rank {v} stopped answering first (suspect)" in text or stopped.format(v) in text
        others = [r for r in range(NPROC) if r != v and stopped.format(r) in text]
        ok = rc == 1 and named and not others and "failed first" not in text
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


def main(runs: int, scenarios: list[str] | None, seed: int) -> list[dict]:
    """``runs`` runs of each scenario; prints a table row per scenario and the failures; the records."""
    header = ("scenario", "runs", "passed", "max s to all gone", "exit codes")
    records, rows = [], []
    for scenario in scenarios or SCENARIOS:
        res = [run_fault(scenario, seed * 1000 + i) for i in range(runs)]
        records += res
        good = [r for r in res if r["ok"]]
        worst = max((r["seconds"] for r in res if r["started"]), default=float("nan"))
        rows.append((scenario, len(res), len(good), f"{worst:.2f}", sorted({r["rc"] for r in res})))
        print(table(rows[-1:], header), flush=True)
        for r in res:
            if not r["ok"]:
                print(f"  FAILED seed {r['seed']}: {r['why']}\n{r['output']}", flush=True)
    print(table(rows, header))
    return records
