"""Issue 19, the launcher on a shared machine: rows 1 and 6, and the leftovers of row 12.

* Row 1: a local launch listens on loopback only (the old launcher hosted torch's rendezvous
  TCPStore, holding a pickled state, on every interface), its run directory is private (0700,
  this user's) and removed afterwards.
* Row 6: ``--timeout`` reaches every process group of a run (torch's subgroups default to 30
  minutes otherwise), and a stopped rank (SIGSTOP) ends the job within the timeout plus a margin,
  named first as the suspect instead of the healthy ranks that timed out waiting for it.
* Row 12 (the launcher's part): a failed launch leaves no temporary directory, and flight dumps
  and heartbeats of an earlier run never enter a new diagnosis.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.helpers import SMALL_CORPUS
from shardkit import ShardkitError
from shardkit._local_world import init_local_world, loopback_interface, private_run_dir
from shardkit.cli.launch import launch_local
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.liveness import Beat, clear_flight_dir, read_heartbeats
from shardkit.train.watchdog import stalled_ranks, to_stop

# --- row 1: nothing listens beyond loopback ----------------------------------------------------


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listeners(pids: list[int]) -> list[tuple[str, int, int]]:
    """``(address, port, pid)`` of every TCP socket in LISTEN state held by ``pids`` (Linux /proc)."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], int(cols[9])
                if state == "0A" and inode in owner:  # 0A: TCP_LISTEN
                    addr, port = local.split(":")
                    out.append((str(_address(addr)), int(port, 16), owner[inode]))
    return out


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def hold_until_inspected(run_dir: str, marks: str) -> str | None:
    """A rank of the inspected launch: join the world, say so, wait until the test has looked."""
    init_local_world(run_dir, timedelta(seconds=60))
    dist.barrier()  # every rank's gloo connections are up
    rank = dist.get_rank()
    with open(os.path.join(marks, f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(os.path.join(marks, "inspected")):
        time.sleep(0.05)
    dist.barrier()
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    dist.destroy_process_group()
    return interface


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_local_launch_listens_on_loopback_only_in_a_private_directory(tmp_path):
    seen: dict = {}

    def inspect() -> None:
        ready = [tmp_path / f"ready{r}" for r in range(2)]
        try:
            end = time.monotonic() + 120
            while not all(p.exists() for p in ready) and time.monotonic() < end:
                time.sleep(0.05)
            workers = [int(p.read_text()) for p in ready]
            seen["listeners"] = listeners([os.getpid(), *workers])
            info = os.stat(seen["run_dir"])
            seen["mode"], seen["uid"] = stat.S_IMODE(info.st_mode), info.st_uid
        finally:
            (tmp_path / "inspected").write_text("")

    with private_run_dir() as run_dir:
        seen["run_dir"] = run_dir
        watcher = threading.Thread(target=inspect)
        watcher.start()
        try:
            results = launch_local(2, hold_until_inspected, run_dir, str(tmp_path), run_dir=run_dir)
        finally:
            watcher.join()
    assert seen["listeners"], "no listener found at all: the inspection saw nothing"
    wide = [entry for entry in seen["listeners"] if not _is_loopback(entry[0])]
    assert not wide, f"listening beyond loopback: {wide}"
    assert seen["mode"] == 0o700 and seen["uid"] == os.getuid(), seen
    assert not os.path.exists(run_dir)
    assert set(results.values()) == {loopback_interface()}  # gloo pinned to loopback in every rank


def test_a_launch_removes_the_run_directories_of_killed_launchers(tmp_path, monkeypatch):
    # a SIGKILLed launcher cannot remove its run directory; the next launch does
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    orphan, alive, other = (
        tmp_path / f"shardkit-run-{gone.pid}-x",
        tmp_path / f"shardkit-run-{os.getpid()}-y",
        tmp_path / "shardkit-flight-z",
    )
    for path in (orphan, alive, other):
        path.mkdir(mode=0o700)
    (orphan / "store").write_text("")
    with private_run_dir() as run_dir:
        assert os.path.dirname(run_dir) == str(tmp_path)
        assert not orphan.exists() and alive.exists() and other.exists()
    assert sorted(os.listdir(tmp_path)) == [other.name, alive.name]


def test_the_proc_parser_sees_a_wide_listener():
    # the inspection above would see a socket on every interface (what the old launcher opened)
    import socket

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as wide, socket.socket() as local:
        wide.bind(("::", 0))
        wide.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        found = {(addr, port) for addr, port, _ in listeners([os.getpid()])}
        assert ("::", wide.getsockname()[1]) in found and ("127.0.0.1", local.getsockname()[1]) in found
    assert not _is_loopback("::") and _is_loopback("127.0.0.1") and _is_loopback("::ffff:127.0.0.1")


# --- row 6: --timeout, heartbeats, the stalled rank named -----------------------------------------


@pytest.mark.slow  # builds a pp_tp mesh's groups (4 core-s); the quick tier trains pp_tp layouts
@pytest.mark.world(4)
def test_every_group_of_a_pipeline_with_stage_tp_sizes_has_the_worlds_timeout():
    # --pp-tp layouts build their groups with new_group, whose default is gloo's 30 minutes

    from shardkit import ParallelDims

    want = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    mesh = ParallelDims(dp_replicate=2, pp_tp=(1, 1)).build_mesh("cpu")
    for name in ("tp", "dp", "stages"):
        group = mesh[name].group if name == "stages" else mesh[name]
        assert group._get_backend(torch.device("cpu")).options._timeout == want, name


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), 1e9])
def test_timeout_must_be_a_finite_positive_number_of_seconds(value):
    with pytest.raises(ShardkitError, match="--timeout must be a finite number of seconds"):
        validate_config(TrainConfig(timeout=value))
    assert validate_config(TrainConfig(timeout=5)).timeout == 5


def _beats(times: dict[int, float], exiting=()) -> dict[int, Beat]:
    return {r: Beat(t, 100 + r, r in exiting) for r, t in times.items()}


def test_stalled_ranks_are_those_whose_heartbeat_stopped_long_before_the_others():
    beats = _beats({0: 1000.0, 1: 992.0, 2: 999.2, 3: 998.5})
    assert stalled_ranks(beats, timeout_s=10) == {1: 8.0}  # lag > max(3 s, timeout / 2)
    assert stalled_ranks(beats, timeout_s=20) == {}  # 8 s behind a 20 s timeout: not yet stalled
    assert stalled_ranks(_beats({0: 1000.0}), timeout_s=10) == {}  # one rank alone has nothing to lag


def test_the_watchdog_stops_a_silent_rank_not_a_slow_or_departing_one():
    # (issue 31: judged by progress; a beat without a progress time made its progress at its beat)
    running = _beats({0: 1000.0, 1: 993.0, 2: 999.5})
    assert set(to_stop(running, {0, 1, 2}, now=1000.5, timeout_s=5)) == {1}  # silent longer than the timeout
    assert to_stop(running, {0, 1, 2}, now=1000.5, timeout_s=10) == {}  # not yet
    # once a rank has left (failed, or exiting), the others are judged by the same deadline
    ending = {0: 1000.0, 1: 994.0, 2: 1000.0}
    assert to_stop(_beats(ending), {1, 2}, now=1000.5, timeout_s=300) == {}  # 6 s late, not 300
    assert set(to_stop(_beats(ending, exiting=(0,)), {0, 1, 2}, now=1000.5, timeout_s=5)) == {1}
    assert to_stop(_beats({0: 900.0, 1: 1000.0}, exiting=(0, 1)), {0, 1}, now=2000.0, timeout_s=5) == {}


def test_clear_flight_dir_removes_only_the_dumps_and_heartbeats(tmp_path):
    for name in (
        "rank0.json",
        "rank1.json.tmp123",
        "heartbeat-rank0",
        "heartbeat-rank1",
        "heartbeat-rank1.tmp",
        "notes.txt",
    ):
        (tmp_path / name).write_text("1.0")
    clear_flight_dir(str(tmp_path), rank=1)
    assert sorted(os.listdir(tmp_path)) == ["heartbeat-rank0", "notes.txt", "rank0.json"]
    clear_flight_dir(str(tmp_path))
    assert os.listdir(tmp_path) == ["notes.txt"]
    assert read_heartbeats(str(tmp_path)) == {}


def test_the_launcher_names_the_stalled_rank_first_not_the_healthy_one_that_timed_out(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardkit.cli.launch import format_failures
    from shardkit.comm.flight_recorder import format_report

    timed_out = tmp_path / "error0.json"  # the healthy rank's error file: it timed out waiting
    timed_out.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: Timed out",
                    "extraInfo": {
                        "py_callstack": "Traceback ...\nRuntimeError: Timed out waiting 5000ms for recv",
                        "timestamp": "1",
                    },
                }
            }
        )
    )
    failures = {0: ProcessFailure(0, 10, 1, str(timed_out)), 1: ProcessFailure(1, 11, -9, str(tmp_path / "none"))}
    text = format_failures(ChildFailedError("worker", failures), stalled={1: 5.0})
    first, second = text.splitlines()
    assert first.startswith("rank 1 stopped answering first (suspect)") and "exit code -9" in first, text
    assert second.startswith("rank 0 also stopped (exit code 1): RuntimeError: Timed out"), text
    # the flight report names the rank that left no record
    assert "no record from rank 1" in format_report({0: []}, world_size=2)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _pid_of_rank(flight: str, rank: int) -> int:
    """The pid a rank wrote into its heartbeat (torch sets RANK inside the spawned process, so
    /proc/PID/environ does not show it)."""
    with open(os.path.join(flight, f"heartbeat-rank{rank}")) as f:
        return int(f.read().split()[1])


STALL_TIMEOUT_S = 5
STALL_MARGIN_S = 30


def _plant_stale_records(flight: str) -> None:
    """An earlier run's leftovers: a dump of rank 1 and an old heartbeat of rank 0."""
    os.makedirs(flight)
    entry = {
        "seq": 0,
        "group_seq": 0,
        "op": "all_reduce",
        "api": "planted_stale_call",
        "phase": "forward",
        "group": [0, 1],
        "group_name": "0",
        "shape": [1],
        "sizes": None,
        "peer": None,
        "src": None,
        "dst": None,
    }
    with open(os.path.join(flight, "rank1.json"), "w") as f:
        json.dump({"rank": 1, "entries": [entry]}, f)
    with open(os.path.join(flight, "heartbeat-rank0"), "w") as f:
        f.write("1.0 1\n")


@pytest.fixture
def short_tmp():
    """An empty directory with a short path, for a job's ``TMPDIR``: the launcher's forkserver
    binds a Unix socket below it, whose path must fit 107 bytes. ``tmp_path`` under
    pytest-xdist (``.../pytest-N/popen-gw1/test_a_stopped_rank_ends_the_j0/tmp``) does not."""
    path = tempfile.mkdtemp(prefix="sk-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_rank_ends_the_job_within_the_timeout_and_is_named_the_suspect(tmp_path, short_tmp):
    report, tmp = tmp_path / "report", short_tmp
    _plant_stale_records(str(report / "flight"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    argv = [
        sys.executable,
        "-m",
        "shardkit",
        "train",
        "--nproc",
        "2",
        "--tp",
        "2",
        "--steps",
        "100000",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--timeout",
        str(STALL_TIMEOUT_S),
        "--report",
        str(report),
        "--data",  # 90 KB, not the 31 MB default corpus rank 0 reads and broadcasts: no claim is about data
        SMALL_CORPUS,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        metrics = report / "metrics.jsonl"
        end = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < end and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.1)  # until rank 0 logged a step: training runs
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        victim = _pid_of_rank(str(report / "flight"), 1)
        # a worker of this launcher: its child, or its forkserver's (shardkit train forks its ranks)
        assert victim in _children(proc.pid) + [p for c in _children(proc.pid) for p in _children(c)]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        out, _ = proc.communicate(timeout=STALL_TIMEOUT_S + STALL_MARGIN_S + 30)
        seconds = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out[-3000:]
    assert seconds <= STALL_TIMEOUT_S + STALL_MARGIN_S, (seconds, out[-3000:])
    failure = out[out.index("shardkit: a worker failed") :]
    lines = failure.splitlines()
    # named first: by the watchdog (issue 31: no progress for --timeout) or, when rank 0's own
    # timeout ended the job first, as the suspect whose heartbeat stopped
    first = ("rank 1 stopped answering first (suspect)", "shardkit's watchdog stopped rank 1: no progress for")
    assert lines[1].startswith(first), failure[-3000:]
    assert "rank 0 failed first" not in failure, failure[-3000:]
    assert "no record from rank 1" in failure  # the flight report names it too
    assert "planted_stale_call" not in out  # the earlier run's dump was cleared at launch
    assert "rank 0 stopped answering" not in out  # and its old heartbeat
    assert os.listdir(tmp) == []  # no temporary directory left by the failed launch
