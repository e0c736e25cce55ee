"""The forked start of a local launch (issue 32, item 5): ranks forked from a forkserver that
imported torch and the model code once, with what a spawned rank had (the launcher's
environment at launch, a private temporary directory, death with the launcher).

The launches run in a process of their own (launch_start_job.py): pytest's process has the test
harness's forkserver. One such process serves both launch tests (its third launch hangs, for the
second test to SIGKILL it).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.limits import patient
from shardkit.cli._fork import _OWNER, _start_time, remove_stale_temps

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_start_job.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One launcher process (launch_start_job.py): two reporting launches, then a third whose
    ranks hang. Yields ``(its folder, its system temporary directory, the launcher)`` once the
    reports are written and the hanging ranks said their pids; killed at the end if still alive."""
    folder = tmp_path_factory.mktemp("launches")
    # the launcher's system temporary directory, which holds its forkserver's socket: a short path
    # of its own (tmp_path_factory's is too deep for a Unix socket under pytest-xdist)
    system_tmp = Path(tempfile.mkdtemp(prefix="sk-"))
    env = {**ENV, "TMPDIR": str(system_tmp)}
    launcher = subprocess.Popen([sys.executable, JOB, str(folder)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + patient(120)
        files = [folder / f"rank{r}.pid" for r in range(2)]
        while not all(f.exists() and f.read_text() for f in files):
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        yield folder, system_tmp, launcher
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        shutil.rmtree(system_tmp, ignore_errors=True)


# The two tests of the launcher process are the slow tier's (three launches, 5 core-s), like the
# other kills of a launcher (test_fault_trials); the quick tier's launches (test_train_run,
# test_launch) fork their ranks the same way.
@pytest.mark.slow
def test_forked_ranks_get_the_launchers_environment_at_each_launch(job):
    launches = json.loads((job[0] / "out.json").read_text())
    assert [launch["mark"] for launch in launches] == ["first", "second"]
    forkservers = set()
    for launch in launches:
        ranks = sorted(launch["ranks"], key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            # the launch's own mark and private temporary directory, though the second launch's
            # forkserver started during the first, with the first's
            assert r["mark"] == launch["mark"], (launch["mark"], r)
            assert r["tmp"].startswith(launch["run_dir"] + os.sep), (launch["run_dir"], r["tmp"])
            # forked by the launcher's forkserver (not spawned by the launcher), which has
            # torch loaded and no thread but its main one (a fork copies only the forking thread)
            assert r["parent"] != launch["launcher"] and r["grandparent"] == launch["launcher"], r
            assert r["torch_in_parent"] and r["parent_threads"] == 1, r
            # each in a session of its own, as torchrun's ranks: the scheduler shares the
            # processors between sessions first (cli/_forkserver_guard.py)
            assert r["session"] == r["pid"] and r["parent_session"] == r["parent"] != launch["session"], r
            forkservers.add(r["parent"])
    assert len(forkservers) == 1  # one forkserver for both launches: the imports are paid once


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie is dead
    except OSError:
        return True


@pytest.mark.slow
def test_a_sigkilled_launcher_takes_its_forkserver_and_ranks_with_it(job):
    folder, system_tmp, launcher = job
    files = [folder / f"rank{r}.pid" for r in range(2)]
    pids = {int(p) for f in files for p in f.read_text().split()}  # both ranks and their forkserver
    assert len(pids) == 3, pids
    launcher.kill()
    launcher.wait()
    killed = time.monotonic()
    while not all(_gone(p) for p in pids) and time.monotonic() - killed < 5:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    # Nothing ran the launcher's exit handler: its forkserver's directory is left, marked
    # with its pid, and the next launch's sweep removes it.
    (left,) = system_tmp.glob("pymp-*")
    assert (left / _OWNER).read_text().split()[0] == str(launcher.pid)
    assert remove_stale_temps(str(system_tmp)) == [str(left)] and not left.exists()


def test_only_a_marked_forkserver_directory_whose_launcher_is_gone_is_swept(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: its pid names no process
    me, started = os.getpid(), _start_time(os.getpid())
    marks = {
        "pymp-dead": f"{ended.pid} 1",  # its launcher is gone
        "pymp-reused": f"{me} {int(started) + 1}",  # a live pid, but not the launcher that marked it
        "pymp-live": f"{me} {started}",  # this process: in use
        "pymp-unmarked": None,  # multiprocessing's own, or another program's
        "other-dead": f"{ended.pid} 1",  # not a multiprocessing directory
    }
    for name, mark in marks.items():
        (tmp_path / name).mkdir()
        if mark is not None:
            (tmp_path / name / _OWNER).write_text(mark)
    removed = remove_stale_temps(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == ["pymp-dead", "pymp-reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-dead", "pymp-live", "pymp-unmarked"]
