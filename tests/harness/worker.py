"""The rank side of a test world: run test bodies sent by :class:`harness.world.World`.

Started by the forkserver with torch already imported. Each rank joins a gloo process group
through a FileStore, then loops: take a :class:`Task` from its own queue, reseed, call the test
function, put the outcome on the shared result queue. Keep imports light and torch-free at the
top: this module is imported in every fresh worker.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import sys
import traceback
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple


class Task(NamedTuple):
    """One test body to run on every rank."""

    path: str  # the test module's file
    func: str  # a module-level function in it
    kwargs: bytes  # pickled in the pytest process, so an unpicklable argument fails there
    nodeid: str  # seeds the RNGs, identically on every rank
    module_name: str | None  # name to register the module under (pytest's, when known)


def _to_file(path: str) -> None:
    """Send this process's fd 1 and 2 (Python's prints and warnings, and C++ output such as
    gloo's and torch's TORCH_WARN lines alike) to ``path``, opened for appending.

    The pytest side empties the file before each task and hands its text to the test's captured
    output, which pytest shows only when the test fails (``-rP`` or ``-s`` show it always):
    ranks no longer print ``[rank r]`` lines into a passing run. O_APPEND keeps every write at
    the end after the other process truncates the file.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line-buffered text streams on the new fds: what a rank printed is on disk before it reports.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a test may have closed or replaced it
            pass


def main(tests_dir, rank, n, store_path, stack_path, pg_timeout, task_q, result_q, out_path=None):
    """Process target of one rank: join the gloo world, then serve tasks until told to stop.
    ``out_path``: the file this rank's stdout and stderr go to (None: the inherited ones)."""
    if tests_dir not in sys.path:  # test modules do `from harness... import ...`
        sys.path.insert(0, tests_dir)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to pytest, which kills us
    if out_path is not None:
        _to_file(out_path)
    faulthandler.enable()  # a segfaulting rank leaves a Python stack on stderr (its output file)
    # On a hang the pytest side sends SIGUSR1 and puts this file into the HANG report.
    faulthandler.register(signal.SIGUSR1, file=open(stack_path, "w"), all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        from shardkit._local_world import loopback_interface

        torch.set_num_threads(1)  # n ranks share 2 cores; more threads only contend
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()  # test worlds listen on loopback only
        store = dist.FileStore(store_path, n)  # a file, not a TCP port: no port clashes
        _share_one_gloo_device()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=pg_timeout))
    except BaseException as exc:
        _flush()
        result_q.put((0, rank, _error_outcome(exc)))
        return
    _flush()
    result_q.put((0, rank, ("ok",)))  # task 0 is the start handshake
    try:
        _serve(rank, task_q, result_q)
    finally:
        dist.destroy_process_group()


def _share_one_gloo_device() -> None:
    """Every gloo group this rank creates from now on uses one transport device.

    torch builds a new device per group, and each device runs an event loop that wakes 100 times a
    second, busy or not (``epoll_wait(..., 10)`` in gloo's ``transport/tcp/loop.cc``): a rank of a
    world that had served the layout tests held ~44 of them, and the suite's idle worlds burned a
    third of a core. One device serves any number of groups (``_Options._devices``): the pairs of
    each group keep their own sockets, which the device's listener tells apart by sequence
    number. The options of torch's ``new_group`` do not reach gloo, hence the subclass. Measured
    over the whole suite on 2 cores: 1187 -> 1116 core-s, and idle worlds no longer need ending.
    """
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    device = base.create_default_device()  # after GLOO_SOCKET_IFNAME: it listens on loopback

    class SharedDeviceGloo(base):
        def __init__(self, store, rank, size, timeout):
            options = base._Options()
            options._devices = [device]
            options._timeout = timeout
            options._threads = 2  # torch's default
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def _serve(rank: int, task_q: Any, result_q: Any) -> None:
    parent = mp.parent_process()
    while True:
        try:
            item = task_q.get(timeout=2.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # pytest died without shutting us down: do not linger
            continue
        if item is None:
            return
        task_id, task = item
        outcome = _run_task(task)
        _flush()  # before the outcome: the pytest side reads the output once every rank reported
        if outcome[0] == "ok" and _group_count() > MAX_GROUPS:
            result_q.put((RESPAWN, rank, ("respawn",)))  # read before the outcome: same queue, same rank
        result_q.put((task_id, rank, outcome))


# Every gloo group keeps threads and sockets of its own: a world that had served the layout and
# planner tests held hundreds of groups (733 threads a rank) and kept the two cores in system
# time. Destroying a finished test's groups is not safe (DTensor's sharding cache hands later
# tests meshes equal by value to old ones, groups included), so a world past this many groups
# asks to be respawned after a passing test instead.
MAX_GROUPS = 64
RESPAWN = -1  # task id of that request


def _group_count() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _run_task(task: Task) -> tuple:
    try:
        fn = getattr(_load_module(task.path, task.module_name), task.func)
        # Reseed right before the call so the RNG state is a function of the test alone,
        # not of what ran before it on this world or of the module's first import.
        _reseed(zlib.crc32(task.nodeid.encode()))
        _clear_flight_recorder()  # a desync report reads only this test's collectives
        value = fn(**pickle.loads(task.kwargs))
        # A test body returns None; a body that reports something (the bad-input catalogue's
        # per-rank outcome records) returns a picklable value, handed back with "ok".
        return ("ok",) if value is None else ("ok", value)
    except BaseException as exc:
        skip = getattr(sys.modules.get("_pytest.outcomes"), "Skipped", None)
        if skip is not None and isinstance(exc, skip):
            return ("skip", str(exc))
        return _error_outcome(exc)


def _error_outcome(exc: BaseException) -> tuple:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # drop the harness frame that called the test
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return ("error", type(exc).__name__, str(exc), text)


_MODULES: dict[str, Any] = {}


def _load_module(path: str, module_name: str | None) -> Any:
    module = _MODULES.get(path)
    if module is None:
        name = module_name or f"_world_{Path(path).stem}_{zlib.crc32(path.encode()):08x}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import test module {path}")
        module = importlib.util.module_from_spec(spec)
        # Registered before running, as a normal import would: dataclasses and pickled
        # arguments look their module up by name.
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        _MODULES[path] = module
    return module


def _clear_flight_recorder() -> None:
    from shardkit.comm import flight_recorder

    if flight_recorder.current is not None:
        flight_recorder.current.clear()


def _reseed(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)
