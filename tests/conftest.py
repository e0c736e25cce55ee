"""pytest wiring of the persistent gloo test worlds (harness/world.py, docs/design.md, Testing).

``@pytest.mark.world(n)`` (optionally ``timeout=SECONDS``, the wall limit, default 60 s) on a
module-level test function runs its body on every rank of an n-rank gloo world instead of in
the pytest process. Its arguments (parametrize values) are pickled to the ranks; fixtures do not
exist there. Worlds are created on first use, kept for the session, and respawned after any
failed, hung or crashed test.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Bytecode caches on, whatever the environment says: container images often set
# PYTHONDONTWRITEBYTECODE=1 (this project's machines do), and then every process the suite starts
# (pytest-xdist's workers rewriting the test modules' asserts, each launch's launcher and
# forkserver, the subprocess checks) compiled shardkit's sources and the tests anew: 35 of the
# quick tier's 345 core-s. Set before the test modules are collected; children inherit it.
# __pycache__ is gitignored.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    # `import harness` here and in the workers, whatever pytest's import mode: the forkserver
    # and the workers start with this process's sys.path.
    sys.path.insert(0, _TESTS_DIR)

from harness.limits import patient  # noqa: E402
from harness.tiers import mark_matrix  # noqa: E402
from harness.world import WALL_LIMIT, WorldPool, set_io_guard  # noqa: E402
from shardkit._quiet import QUIET_ENV  # noqa: E402

# No Hugging Face progress bars ("Writing model shards", loading bars) or advisory logs in test
# output: set before the forkserver starts, so every rank inherits it.
os.environ.update(QUIET_ENV)
# The trainer's token cache ($XDG_CACHE_HOME/shardkit) of this session only: tests never read
# nor fill the user's own cache, and entries still serve later tests of the session.
_CACHE_HOME = tempfile.mkdtemp(prefix="shardkit-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)

_POOL = WorldPool()


def pytest_configure(config: pytest.Config) -> None:
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        # Ranks write to files of their own (harness/world.py); the forkserver, which prints
        # its own import warnings, must still start outside pytest's fd capture or they would
        # land in one test's capture file for the rest of the session.
        set_io_guard(capman.global_and_fixture_disabled)


# Files whose tests launch real jobs (`shardkit train`, the launcher, the bench's startup case) and
# wait on them, their timeouts and heartbeats. With pytest-xdist (`-n 2 --dist loadgroup`, the
# README's test command) they share one group, so they run one after another on one worker while
# the other worker runs the world tests beside them: two launches never contend with each other,
# and their waits leave a core to the other worker. Without xdist the mark does nothing.
WAIT_BOUND = frozenset(
    {
        "bench/test_startup_case.py",
        "cli/test_fault_trials.py",
        "cli/test_launch_start.py",
        "cli/test_multi_node.py",
        "cli/test_slow_rank.py",
        "cli/test_saturated_save_hf.py",
        "cli/test_train_papercuts.py",
        "cli/test_train_run.py",
        "train/test_watchdog.py",
        "catalogue/test_hash_bomb_cli.py",
        "catalogue/test_shared_machine_launch.py",
    }
)


def _wait_bound(item: pytest.Item) -> bool:
    return Path(os.path.relpath(item.path, _TESTS_DIR)).as_posix() in WAIT_BOUND


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselection reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The quick tier keeps one case per value of each parametrize argument; the rest of each
    # product is the matrix tier (harness/tiers.py: mark_matrix).
    mark_matrix(items)
    for item in items:
        if _wait_bound(item):
            item.add_marker(pytest.mark.xdist_group("waits"))


def _world_args(item: pytest.Function, marker: pytest.Mark) -> tuple[int, float]:
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.world(n) needs an int n >= 1")
    if item.cls is not None:
        raise pytest.UsageError(f"{item.nodeid}: world tests must be module-level functions")
    return n, float(marker.kwargs.get("timeout", WALL_LIMIT))


def _pickle_problem(kwargs: dict) -> str:
    try:
        pickle.dumps(kwargs)
    except Exception as exc:  # pickling raises several types (PicklingError, TypeError, ...)
        return repr(exc)
    return ""


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world")
    if marker is None:
        return None
    n, limit = _world_args(pyfuncitem, marker)
    # The same selection pytest's own pyfunc_call makes: the function's own arguments.
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    problem = _pickle_problem(kwargs)
    if problem:
        pytest.fail(f"world test arguments must be picklable: {problem}", pytrace=False)
    result = _POOL.get(n).run(
        pyfuncitem.path,
        pyfuncitem.originalname,
        kwargs,
        nodeid=pyfuncitem.nodeid,
        module_name=pyfuncitem.module.__name__,
        timeout=patient(limit),  # the HANG limit, stretched on a loaded machine
    )
    # What the ranks printed, into this test's captured output: pytest shows it under the
    # failure ("Captured stdout call"), and for a passing test only with -rP or -s.
    sys.stdout.write(getattr(result, "output_text", lambda: "")())
    if result.skipped:
        pytest.skip(result.outcomes[0][1])
    if not result.ok:
        pytest.fail(result.failure_message(), pytrace=False)
    return True


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _POOL.shutdown()


@pytest.fixture
def short_tmp_path():
    """A private directory (mode 0700) with a short path, removed after the test: for a TMPDIR under
    which a local launch's forkserver binds its Unix socket (at most 75 characters: the socket's
    path must fit in 107 bytes, ``shardkit.cli._fork.check_socket_dir``). ``tmp_path`` is too deep
    for that under pytest-xdist (``.../pytest-N/popen-gw1/<test name>/``)."""
    path = tempfile.mkdtemp(prefix="sk-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def hide_module(monkeypatch: pytest.MonkeyPatch):
    """``hide_module("name")``: ``import name`` and ``find_spec("name")`` fail for the test, as if
    the package were not installed (a None entry in sys.modules; its loaded submodules dropped)."""
    import sys

    def hide(name: str) -> None:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)

    return hide
