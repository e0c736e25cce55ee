"""Persistent multi-process gloo worlds for tests (docs/design.md, Testing).

A :class:`World` is ``n`` worker processes forked from a forkserver that has torch preloaded
(about 1 s to start, against 4-10 s with ``spawn``). Each rank has its own task queue, so every
rank runs every task exactly once and in the same order; all ranks answer on one result queue.
The pytest side waits with a wall limit, notices dead ranks, and kills the world after any
failure: ranks that failed at different points may have collectives out of step, and a fresh
world costs about a second. A rank's stdout and stderr go to a file of its own, emptied before
each task; :attr:`WorldResult.output` hands back what the task printed (conftest puts it in the
test's captured output, which pytest shows for a failing test only).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .limits import patient
from .worker import RESPAWN as _RESPAWN
from .worker import Task
from .worker import main as _worker_main

__all__ = ["PG_TIMEOUT", "WALL_LIMIT", "World", "WorldPool", "WorldResult", "set_io_guard"]

# Short, so that a rank left alone in a collective errors out well before the wall limit; stretched
# by the load when a world starts (patient): at load 40-80 (or beside another pytest-xdist worker)
# one rank tracing Dynamo took longer than 15 s while its peer waited in a collective.
PG_TIMEOUT = float(os.environ.get("SHARDKIT_TEST_PG_TIMEOUT", "15"))
WALL_LIMIT = float(os.environ.get("SHARDKIT_TEST_WALL_LIMIT", "60"))
# After one rank fails, how long to wait for the others before killing: they are usually stuck
# in a collective with the failed rank and would only report a gloo timeout PG_TIMEOUT later.
ERROR_GRACE = float(os.environ.get("SHARDKIT_TEST_ERROR_GRACE", "2"))
START_LIMIT = 60.0
TESTS_DIR = str(Path(__file__).resolve().parents[1])
_POLL_S = 0.05  # how often the waiting side checks for dead ranks and deadlines

_CTX: Any = None
_IO_GUARD: Callable[[], ContextManager[Any]] = nullcontext


def set_io_guard(factory: Callable[[], ContextManager[Any]]) -> None:
    """Set the context in which the forkserver starts (conftest passes pytest's capture-off).

    Workers inherit the forkserver's stdout/stderr, not those of the process that asks for
    them; starting it inside pytest's fd capture would send every rank's output into one test's
    capture file for the rest of the session.
    """
    global _IO_GUARD
    _IO_GUARD = factory


_HF_PRELOAD = [
    f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "gemma2")
]


_SHARDKIT_PRELOAD = ["shardkit", "shardkit.train.run"]
# conv-ae's photo (matplotlib.image.imread of a JPEG, and its reconstruction PNG): about 0.4 s of
# CPU per rank in each world's first conv-ae test otherwise.
_PLOT_PRELOAD = ["matplotlib.image", "matplotlib.cbook", "PIL.JpegImagePlugin", "PIL.PngImagePlugin"]


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # Must be set before the forkserver first starts; forked workers then share the
        # imports. pytest too: every worker re-imports the parent's __main__ (pytest's) and
        # every test module imports it, about 0.3 s of CPU per rank and (re)spawn otherwise.
        # transformers' modeling code likewise (5-50 s per world under load otherwise); the
        # forkserver ignores modules that fail to import.
        # shardkit too: importing it (torch.distributed.checkpoint, transformers glue) costs
        # about 5 s of CPU per rank on the loaded machine, paid at every respawn otherwise.
        # The trainer (shardkit.train.run: checkpointing, parallelize, the model specs) too:
        # 1.4-1.8 s of CPU per rank on an idle machine, paid by every rank of every world start
        # (each world size, each respawn) whose first trainer test imported it.
        preload = ["torch", "torch.distributed", "pytest", *_HF_PRELOAD, *_SHARDKIT_PRELOAD, *_PLOT_PRELOAD]
        ctx.set_forkserver_preload(preload)
        _CTX = ctx
    return _CTX


@dataclass
class WorldResult:
    """What every rank of one task did. ``outcomes`` is in arrival order, one tuple per rank:
    ``("ok",)`` (``("ok", value)`` when the body returned a value), ``("skip", reason)``,
    ``("error", type_name, message, traceback)`` or ``("died", exit_code)``; ranks missing from
    it never reported."""

    n: int
    limit: float
    outcomes: dict[int, tuple] = field(default_factory=dict)
    hang: bool = False
    stacks: dict[int, str] = field(default_factory=dict)  # faulthandler dumps of hung ranks
    elapsed: float = 0.0
    output: dict[int, str] = field(default_factory=dict)  # what each rank printed during the task

    def output_text(self) -> str:
        """Every rank's output of the task, each line prefixed ``[rank r]`` ("" when silent)."""
        return "".join(
            f"[rank {r}] {line}" + ("" if line.endswith("\n") else "\n")
            for r, text in sorted(self.output.items())
            for line in text.splitlines(keepends=True)
        )

    def _all(self, kind: str) -> bool:
        return len(self.outcomes) == self.n and all(o[0] == kind for o in self.outcomes.values())

    @property
    def ok(self) -> bool:
        return self._all("ok")

    @property
    def skipped(self) -> bool:  # every rank called pytest.skip
        return self._all("skip")

    @property
    def failed(self) -> bool:
        return not (self.ok or self.skipped)

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.n) if r not in self.outcomes]

    def failure_message(self) -> str:
        """The lead failure in full (a death, else the first error, else the hang), then one
        line on every other rank, then the stacks of hung ranks."""
        kinds = {kind: [r for r, o in self.outcomes.items() if o[0] == kind] for kind in ("died", "error")}
        lead, lines = None, []
        if kinds["died"]:
            lead = kinds["died"][0]
            lines.append(f"rank {lead} died with exit code {_exit_text(self.outcomes[lead][1])}")
        elif kinds["error"]:
            lead = kinds["error"][0]
            lines += [f"rank {lead} of {self.n} failed first; its traceback:", self.outcomes[lead][3].rstrip()]
        elif self.hang:
            lines.append(
                f"HANG: rank(s) {self.missing} of {self.n} did not report within "
                f"{self.limit:g} s; the world was killed and respawns on next use"
            )
        else:
            lines.append(f"ranks disagree on skipping: {self.outcomes}")
        others = [f"rank {r} {self._describe(r)}" for r in range(self.n) if r != lead]
        if others:
            lines.append("other ranks: " + "; ".join(others))
        for r, stack in self.stacks.items():
            lines.append(f"--- rank {r} stack when killed ---\n{stack.rstrip()}")
        return "\n".join(lines)

    def _describe(self, rank: int) -> str:
        outcome = self.outcomes.get(rank)
        if outcome is None:
            return "did not report (killed)"
        if outcome[0] == "error":
            first = (outcome[2].splitlines() or [""])[0][:120]
            return f"raised {outcome[1]}: {first}"
        if outcome[0] == "died":
            return f"died with exit code {_exit_text(outcome[1])}"
        return {"ok": "ok", "skip": "skipped"}[outcome[0]]


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


class World:
    """``n`` gloo ranks that run test bodies on demand; started lazily, respawned after failures.

    Example:
        >>> world = World(2)
        >>> result = world.run("tests/test_x.py", "body", {"size": 3})
        >>> result.ok, result.failure_message()
        >>> world.shutdown()
    """

    def __init__(self, n: int, *, pg_timeout: float = PG_TIMEOUT) -> None:
        self.n, self.pg_timeout = n, pg_timeout
        self.starts = 0  # how many times the processes were (re)spawned
        self._procs: list[Any] = []
        self._task_qs: list[Any] = []
        self._result_q: Any = None
        self._tmpdir: str | None = None
        self._ids = itertools.count(1)
        self._respawn = False

    def start(self) -> None:
        """Spawn the ranks and wait for their process group (no-op when already running)."""
        if self._procs:
            return
        ctx = _context()
        with _IO_GUARD():
            mp.forkserver.ensure_running()
        self._tmpdir = tempfile.mkdtemp(prefix=f"shardkit-world{self.n}-")
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(self.n)]
        for r in range(self.n):
            args = (
                TESTS_DIR,
                r,
                self.n,
                os.path.join(self._tmpdir, "store"),
                self._stack_path(r),
                patient(self.pg_timeout),
                self._task_qs[r],
                self._result_q,
                self._out_path(r),
            )
            proc = ctx.Process(target=_worker_main, args=args, name=f"world{self.n}-rank{r}")
            proc.daemon = True  # multiprocessing's atexit kills them if shutdown never runs
            proc.start()
            self._procs.append(proc)
        self.starts += 1
        result = self._collect(0, patient(START_LIMIT))
        if not result.ok:
            output = "".join(self._read_output(r) for r in range(self.n))
            self.kill()
            raise RuntimeError(f"world of {self.n} failed to start: {result.failure_message()}\n{output}")

    def run(
        self,
        path: str | os.PathLike,
        func: str,
        kwargs: dict | None = None,
        *,
        nodeid: str | None = None,
        module_name: str | None = None,
        timeout: float = WALL_LIMIT,
    ) -> WorldResult:
        """Run ``func(**kwargs)`` from the module at ``path`` on every rank and gather outcomes.

        After a failure, hang or death the world is killed; the next call respawns it.
        """
        blob = pickle.dumps(kwargs or {})
        self.start()
        task_id = next(self._ids)
        task = Task(str(path), func, blob, nodeid or f"{path}::{func}", module_name)
        for r in range(self.n):
            os.truncate(self._out_path(r), 0)  # the ranks append: this task's output only
        for q in self._task_qs:
            q.put((task_id, task))
        try:
            result = self._collect(task_id, timeout)
            if result.hang:
                result.stacks = self._dump_stacks(result.missing)
            result.output = {r: text for r in range(self.n) if (text := self._read_output(r))}
        except BaseException:  # e.g. Ctrl-C while waiting: do not leave ranks mid-test
            self.kill()
            raise
        if result.failed:
            self.kill()
        elif self._respawn:  # too many process groups (worker.MAX_GROUPS): start afresh next time
            self.shutdown()
        return result

    def _collect(self, task_id: int, limit: float) -> WorldResult:
        result = WorldResult(self.n, limit=limit)
        start = time.monotonic()
        first_error = None
        while len(result.outcomes) < self.n:
            try:
                tid, rank, outcome = self._result_q.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            else:
                if tid == _RESPAWN:
                    self._respawn = True
                elif tid == task_id:
                    result.outcomes[rank] = outcome
                    if outcome[0] == "error" and first_error is None:
                        first_error = time.monotonic()
                continue
            now = time.monotonic()
            if self._note_deaths(task_id, result):
                break
            if first_error is not None and now - first_error > ERROR_GRACE:
                break
            if now - start > limit:
                result.hang = True
                break
        result.elapsed = time.monotonic() - start
        return result

    def _note_deaths(self, task_id: int, result: WorldResult) -> bool:
        dead = [r for r, p in enumerate(self._procs) if r not in result.outcomes and p.exitcode is not None]
        if not dead:
            return False
        self._drain(task_id, result)  # a rank may have reported just before another died
        for r in dead:
            result.outcomes.setdefault(r, ("died", self._procs[r].exitcode))
        return True

    def _drain(self, task_id: int, result: WorldResult) -> None:
        while True:
            try:
                tid, rank, outcome = self._result_q.get_nowait()
            except queue.Empty:
                return
            if tid == task_id:
                result.outcomes.setdefault(rank, outcome)

    def _out_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir or "", f"out-{rank}.txt")

    def _read_output(self, rank: int) -> str:
        try:
            return Path(self._out_path(rank)).read_text(errors="replace")
        except OSError:  # a rank that died before creating it
            return ""

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir or "", f"stack-{rank}.txt")

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) before the kill."""
        for r in ranks:
            if self._procs[r].exitcode is None:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 1.0
        paths = {r: self._stack_path(r) for r in ranks}
        while time.monotonic() < deadline and not all(os.path.getsize(p) for p in paths.values()):
            time.sleep(0.02)
        time.sleep(0.05)  # the dump is written in pieces; let the last one land
        return {r: Path(p).read_text(errors="replace") for r, p in paths.items()}

    def kill(self) -> None:
        """SIGKILL every rank now; the next :meth:`run` respawns the world."""
        for p in self._procs:
            if p.exitcode is None:
                p.kill()
        for p in self._procs:
            p.join(5)
        self._release()

    def shutdown(self, limit: float = 5.0) -> None:
        """Ask the ranks to leave their process group and exit; kill any that do not."""
        self._ask_to_leave()
        self._finish(time.monotonic() + limit)

    def _ask_to_leave(self) -> None:
        for q in self._task_qs:
            q.put(None)

    def _finish(self, deadline: float) -> None:
        if not self._procs:
            return
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _release(self) -> None:
        for q in [*self._task_qs, self._result_q]:
            if q is not None:
                q.close()
                q.cancel_join_thread()  # the reader may be dead: never block on a flush
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._procs, self._task_qs, self._result_q, self._tmpdir = [], [], None, None
        self._respawn = False


class WorldPool:
    """One :class:`World` per world size, created on first use and kept for the session."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def get(self, n: int) -> World:
        if n not in self._worlds:
            self._worlds[n] = World(n)
        return self._worlds[n]

    def shutdown(self, limit: float = 5.0) -> None:
        """Every world asked to leave at once, then given one common ``limit``: the worlds leave
        their process groups side by side (one after another, 4 worlds took up to 4 limits)."""
        for world in self._worlds.values():
            world._ask_to_leave()
        deadline = time.monotonic() + limit
        for world in self._worlds.values():
            world._finish(deadline)
        self._worlds.clear()
