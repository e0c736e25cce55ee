"""Controller of the bad-input catalogue: run every case in both modes, classify, count.

Each world size gets one persistent gloo world (tests/harness/world.py: forkserver, FileStore,
one task queue per rank). A case is one task; every rank answers with the record of
:func:`bad_input_rank.run_case`. The world survives clean outcomes (a correct result, or the
same ShardkitError on every rank followed by a working all-reduce) and is killed and respawned
after anything else, since ranks that failed apart may have collectives out of step:

* a rank that died (gloo ``terminate called``, SIGABRT) -> ``abort``;
* every rank reported: all correct -> ``correct``; any result that differs from the
  single-process reference (or any result for an input without a valid answer) -> ``wrong``;
  the same ShardkitError (type and message) on every rank, each within ``ERROR_LIMIT`` -> the
  follow-up all-reduce decides ``same_error`` or ``same_error_unusable``; anything else
  (different errors, a mix of results and errors) -> ``partial``; the same error, but later
  than ``ERROR_LIMIT`` on some rank, is run once more (the shared cores can deschedule a rank
  for seconds) and is ``partial`` if it is late again;
* some ranks never reported: ``partial`` when another rank did (the others hang: not reported
  ``ERROR_LIMIT`` after the first error, ``HANG_LIMIT`` in the check mode, whose errors must
  reach every rank, or ``HANG_LIMIT`` after the start), ``hang`` when none did.

The process-group timeout is long on purpose: a hang is seen by the wall limits here, not by
a gloo timeout that would turn it into an error.

A ``hang`` is then put to the test of the issue's desync proof: the case runs again in a fresh
world, on a copy of the world group whose process-group timeout is ``DESYNC_PG_TIMEOUT``, every
rank dumping its flight recorder after the case (:mod:`shardkit.comm.flight_recorder`). It is a ``desync`` only if every
rank raised within that timeout + 10 s and the report over every rank's dump names the first
divergent call: every rank of its group (or P2P channel) on one side or the other, and the api
the case called; otherwise it stays a ``hang``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
for _p in (_HERE, _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bad_input_rank import CASE_MODULES, Case  # noqa: E402

from harness.worker import Task  # noqa: E402
from harness.world import START_LIMIT, World  # noqa: E402
from shardkit.comm import flight_recorder  # noqa: E402

__all__ = ["OUTCOMES", "MODES", "Result", "all_cases", "run_catalogue", "table", "goal_failures", "describe"]

ERROR_LIMIT = 2.0  # s: "the same error on every rank within 2 s"
HANG_LIMIT = 4.0  # s without any report: every rank hangs (cases take milliseconds)
PG_TIMEOUT = 60.0
DESYNC_PG_TIMEOUT = 3.0  # s: the process-group timeout of a hang's rerun
DESYNC_LIMIT = DESYNC_PG_TIMEOUT + 10.0  # s: "diagnosed within the process-group timeout + 10 s"
RANK_FILE = str(Path(_HERE) / "bad_input_rank.py")
MODES = (("default", False), ("check mode", True))
OUTCOMES = {
    "same_error": "same ShardkitError on every rank within 2 s, group usable",
    "same_error_unusable": "same ShardkitError on every rank, group unusable after",
    "partial": "error on some ranks, the others hang or fail differently",
    "desync": "desync: every rank fails by the process-group timeout + 10 s, the flight recorder names the call",
    "hang": "every rank hangs",
    "abort": "process abort (gloo `terminate called`, SIGABRT)",
    "wrong": "silent wrong result",
    "correct": "correct (the input was fine)",
}


@dataclass(frozen=True)
class Result:
    case: Case
    mode: str
    outcome: str
    detail: str


def all_cases() -> list[Case]:
    cases = []
    for name in CASE_MODULES:
        cases += importlib.import_module(name).CASES.values()
    return cases


class _CatalogueWorld(World):
    """A :class:`World` whose tasks report records, collected with the catalogue's time limits."""

    def call(
        self, func: str, kwargs: dict, task_name: str, grace: float = ERROR_LIMIT, limit: float = HANG_LIMIT
    ) -> dict:
        """Run ``func(**kwargs)`` of the rank module on every rank: {rank: outcome} of those
        that reported (or died) within the limits: ``grace`` seconds after the first rank that
        reported an error, ``limit`` after the start."""
        if not self._procs:
            self.start()
            self._warm()
        return self._collect_records(func, kwargs, task_name, grace, limit)

    def _warm(self) -> None:
        """Import the case modules on every rank of a fresh world, without a case's time limit
        (a first import of shardkit and transformers takes seconds on a loaded machine)."""
        result = self.run(RANK_FILE, "prepare", {}, module_name="bad_input_rank", timeout=START_LIMIT)
        if not result.ok:
            raise RuntimeError(f"catalogue world of {self.n} failed to import its cases: {result.failure_message()}")

    def _collect_records(self, func: str, kwargs: dict, task_name: str, grace: float, limit: float) -> dict:
        task_id = next(self._ids)
        task = Task(RANK_FILE, func, pickle.dumps(kwargs), task_name, "bad_input_rank")
        for q in self._task_qs:
            q.put((task_id, task))
        outcomes: dict[int, tuple] = {}
        start, first = time.monotonic(), None
        while len(outcomes) < self.n:
            try:
                tid, r, outcome = self._result_q.get(timeout=0.01)
            except queue.Empty:
                pass
            else:
                if tid == task_id:
                    outcomes[r] = outcome
                    failed = outcome[0] != "ok" or (isinstance(outcome[1], dict) and outcome[1].get("kind") == "error")
                    if failed and first is None:
                        first = time.monotonic()
                continue
            now = time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if r not in outcomes and p.exitcode is not None]
            if dead:
                time.sleep(0.2)  # let the others' reports (or deaths) of the same abort land
                while True:
                    try:
                        tid, r, outcome = self._result_q.get_nowait()
                    except queue.Empty:
                        break
                    if tid == task_id:
                        outcomes.setdefault(r, outcome)
                for r, p in enumerate(self._procs):
                    if r not in outcomes and p.exitcode is not None:
                        outcomes[r] = ("died", p.exitcode)
                break
            if first is not None and now - first > grace:
                break
            if now - start > limit:
                break
        return outcomes


def _records(outcomes: dict) -> dict:
    """rank -> record; a rank whose task itself failed (a harness error) becomes an error record."""
    out = {}
    for r, o in outcomes.items():
        if o[0] == "ok":
            out[r] = o[1]
        elif o[0] == "died":
            out[r] = {"kind": "died", "code": o[1]}
        else:
            out[r] = {"kind": "error", "type": o[1], "shardkit": False, "msg": o[2], "elapsed": 0.0}
    return out


def _classify(n: int, records: dict) -> tuple[str, str]:
    """(outcome, detail) of one case run; ``same_error`` still needs the follow-up."""
    if any(rec["kind"] == "died" for rec in records.values()):
        dead = sorted(r for r, rec in records.items() if rec["kind"] == "died")
        return "abort", f"ranks {dead} died ({[records[r]['code'] for r in dead]})"
    missing = [r for r in range(n) if r not in records]
    if missing and len(missing) == n:
        return "hang", "no rank reported"
    if missing:
        return "partial", f"ranks {missing} hang; " + _errors(records)
    kinds = {rec["kind"] for rec in records.values()}
    if kinds == {"ok"}:
        bad = [r for r, rec in records.items() if not rec["match"]]
        return ("wrong", f"ranks {bad} differ from the reference") if bad else ("correct", "")
    if kinds == {"error"}:
        keys = {(rec["type"], rec["msg"]) for rec in records.values()}
        slow = [r for r, rec in records.items() if rec["elapsed"] > ERROR_LIMIT]
        if len(keys) == 1 and all(rec["shardkit"] for rec in records.values()):
            if slow:
                return "partial", f"the same error, but ranks {slow} took over {ERROR_LIMIT:g} s: " + _errors(records)
            return "same_error", records[0]["type"] + ": " + records[0]["msg"][:200]
    return "partial", _errors(records)


def _errors(records: dict) -> str:
    parts = []
    for r, rec in sorted(records.items()):
        if rec["kind"] == "error":
            parts.append(f"rank {r}: {rec['type']}: {rec['msg'][:150]}")
        else:
            parts.append(f"rank {r}: {rec['kind']}")
    return "; ".join(parts)


def _run_one(world: _CatalogueWorld, case: Case, mode: str, check: bool) -> Result:
    task = f"{case.module}::{case.name}[{mode}]"
    outcome, detail = _run_case(world, case, check, task)
    if detail.startswith("the same error, but"):
        # The same error everywhere, late only because a rank was descheduled (the 2 cores are
        # shared with many processes): one rerun decides whether the op or the machine was slow.
        outcome, detail = _run_case(world, case, check, task + "::rerun")
    usable = False
    if outcome in ("correct", "wrong", "same_error"):  # every rank returned: are they still in step?
        recs = _records(world.call("followup", {}, task + "::followup"))
        usable = len(recs) == case.n and all(rec.get("ok") is True for rec in recs.values())
        if outcome == "same_error" and not usable:
            outcome = "same_error_unusable"
    if not usable:
        world.kill()  # ranks that failed apart may be out of step: a fresh world for the next case
    return Result(case, mode, outcome, detail)


def _run_case(world: _CatalogueWorld, case: Case, check: bool, task: str) -> tuple[str, str]:
    # Check mode: a rank that reports the agreed error late (descheduled) is waited for, so that
    # it is seen as late (and rerun) rather than as hanging.
    grace = HANG_LIMIT if check else ERROR_LIMIT
    outcomes = world.call("run_case", {"module": case.module, "name": case.name, "check": check}, task, grace)
    return _classify(case.n, _records(outcomes))


def _desync(hung: Result) -> Result:
    """Rerun a case that hung every rank in a world of its own, on a group with a
    ``DESYNC_PG_TIMEOUT`` process-group timeout, every rank dumping its flight recorder: a
    ``desync`` when every rank raised within ``DESYNC_LIMIT`` and the report names the call,
    else still the ``hang`` (with why not)."""
    case, check = hung.case, hung.mode == "check mode"
    world = _CatalogueWorld(case.n, pg_timeout=PG_TIMEOUT)
    directory = tempfile.mkdtemp(prefix="shardkit-desync-")
    try:
        kwargs = {
            "module": case.module,
            "name": case.name,
            "check": check,
            "directory": directory,
            "timeout": DESYNC_PG_TIMEOUT,
        }
        task = f"{case.module}::{case.name}[{hung.mode}]::desync"
        records = _records(world.call("run_case_recorded", kwargs, task, DESYNC_LIMIT, DESYNC_LIMIT))
        why = _undiagnosed(case, records, directory)
        if why is None:
            slowest = max(rec["elapsed"] for rec in records.values())
            first = flight_recorder.format_report(directory).splitlines()[0]
            detail = f"every rank raised within {slowest:.1f} s (timeout {DESYNC_PG_TIMEOUT:g} s); {first}"
            return Result(case, hung.mode, "desync", detail)
        return Result(
            case, hung.mode, "hang", f"{hung.detail}; with a {DESYNC_PG_TIMEOUT:g} s process-group timeout: {why}"
        )
    finally:
        world.kill()  # the ranks of a desync are out of step
        shutil.rmtree(directory, ignore_errors=True)


def _undiagnosed(case: Case, records: dict, directory: str) -> str | None:
    """Why a desync rerun is not diagnosed (None when it is): a rank that did not raise within
    ``DESYNC_LIMIT`` or wrote no dump, or a first divergence that misses a rank of its stream or
    does not name the api the case called."""
    late = [
        r
        for r in range(case.n)
        if r not in records or records[r]["kind"] != "error" or records[r]["elapsed"] > DESYNC_LIMIT
    ]
    if late:
        return f"ranks {late} did not raise within {DESYNC_LIMIT:g} s: {_errors(records)}"
    dumps = flight_recorder.load_dumps(directory)
    if sorted(dumps) != list(range(case.n)):
        return f"dumps of ranks {sorted(dumps)} only"
    found = flight_recorder.diagnose(dumps)
    if not found:
        return flight_recorder.format_report(dumps)
    first = found[0]
    named = sorted(r for ranks, _ in first.sides for r in ranks)
    apis = {e.api for _, e in first.sides if e is not None}
    if named != sorted(first.channel or first.group) or not apis & set(case.op.split("/")):
        return "the first divergence does not name the call: " + first.describe()
    return None


def _run_world(n: int, cases: list[Case], progress, rerun) -> list:
    """The results of ``cases`` on one world, in order; a hang is handed to ``rerun``, whose
    future stands in its place."""
    world = _CatalogueWorld(n, pg_timeout=PG_TIMEOUT)
    results: list = []
    try:
        for case in cases:
            for mode, check in MODES:
                result = _run_one(world, case, mode, check)
                if result.outcome == "hang":
                    results.append(rerun(result))
                    continue
                results.append(result)
                if progress is not None:
                    progress(result)
    finally:
        world.shutdown()
    return results


def run_catalogue(cases: list[Case] | None = None, progress=None, cases_per_world: int = 35) -> list[Result]:
    """Every case in both modes; one :class:`Result` per (case, mode), in catalogue order.

    Cases of one world size are dealt round-robin to one world per ``cases_per_world`` cases,
    and all the worlds run at once (one thread each): most of a run is waiting (the 2 s of an
    error on one rank, a hang's limit, a respawn), which overlaps, while the cases themselves
    take milliseconds. A hang's desync rerun (:func:`_desync`, mostly a wait for the short
    process-group timeout) runs on a world of its own while its world goes on with the next case.
    """
    cases = all_cases() if cases is None else cases
    jobs = []
    for n in sorted({c.n for c in cases}):
        mine = [c for c in cases if c.n == n]
        k = -(-len(mine) // cases_per_world)
        jobs += [(n, mine[i::k]) for i in range(k) if mine[i::k]]
    with ThreadPoolExecutor(len(jobs)) as desyncs:

        def rerun(hung: Result) -> Future:
            future = desyncs.submit(_desync, hung)
            if progress is not None:
                future.add_done_callback(lambda f: progress(f.result()))
            return future

        with ThreadPoolExecutor(len(jobs)) as pool:
            done = [r for rs in pool.map(lambda job: _run_world(*job, progress, rerun), jobs) for r in rs]
        done = [r.result() if isinstance(r, Future) else r for r in done]
    order = {(c.module, c.name): i for i, c in enumerate(cases)}
    return sorted(done, key=lambda r: (order[r.case.module, r.case.name], r.mode != "default"))


def counts(results: list[Result], fingerprint: bool | None = None) -> dict[tuple[str, str], int]:
    sel = [r for r in results if fingerprint is None or r.case.fingerprint == fingerprint]
    return Counter((r.outcome, r.mode) for r in sel)


def table(results: list[Result]) -> str:
    """The markdown table of counts, outcome x mode (fingerprint cases counted separately too)."""
    c, fp = counts(results), counts(results, fingerprint=True)
    n_cases = len({(r.case.module, r.case.name) for r in results})
    n_fp = len({(r.case.module, r.case.name) for r in results if r.case.fingerprint})
    lines = ["| outcome | default | check mode |", "| --- | --- | --- |"]
    for key, text in OUTCOMES.items():
        cells = []
        for mode, _ in MODES:
            cell = str(c[key, mode])
            if fp[key, mode]:
                cell += f" ({fp[key, mode]} fingerprint)"
            cells.append(cell)
        lines.append(f"| {text} | {cells[0]} | {cells[1]} |")
    lines.append(
        f"| cases (of which the fingerprint's: per-rank weights or inputs) | {n_cases} ({n_fp}) | {n_cases} ({n_fp}) |"
    )
    return "\n".join(lines)


def goal_failures(results: list[Result]) -> list[tuple[Result, str]]:
    """The issue's goals, as ``(result, goal)`` for every violation (empty when all are met).

    Default mode: an uneven shard without its sizes neither aborts nor gives a wrong result.
    Check mode: every case is correct or the same ShardkitError on every rank within 2 s with
    the group usable after, except the fingerprint's cases (per-rank weights or inputs).
    Both: no case hangs every rank (a ``desync``, every rank failing at the process-group
    timeout with the call named by the flight recorder, is the default mode's answer to ranks
    that disagree without checks), and every valid input (control, uneven) is correct.
    """
    bad = []
    for r in results:
        if r.outcome == "hang":
            bad.append((r, "no hang"))
        if r.mode == "default" and r.case.kind == "uneven" and r.outcome in ("abort", "wrong"):
            bad.append((r, "uneven without sizes works by default"))
        if r.mode == "check mode" and not r.case.fingerprint and r.outcome not in ("correct", "same_error", "hang"):
            bad.append((r, "check mode: correct or one agreed error"))
        if r.case.kind in ("control", "uneven") and r.outcome not in ("correct", "hang"):
            bad.append((r, "a valid input gives the right result"))
    return bad


def describe(failure: tuple[Result, str]) -> str:
    r, goal = failure
    return f"{goal}: {r.case.name} [{r.mode}]: {r.outcome}: {r.detail[:300]}"
