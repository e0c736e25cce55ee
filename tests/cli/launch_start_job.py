"""The launcher process of tests/cli/test_launch_start.py: ``launch_local(preload=...)`` as
``shardkit train`` runs it, in a process of its own (pytest's process runs the test harness's
forkserver, and a process has one).

``python launch_start_job.py DIR``: two launches one after the other, each with its own
``SHARDKIT_TEST_MARK``, the second on the forkserver the first started; every rank reports what it
sees, written to ``DIR/out.json``. Then a third launch on the same forkserver: each rank writes
``DIR/rankN.pid`` (its pid and its parent's) and sleeps, for the test to SIGKILL this launcher.
One process serves both tests: each launcher pays an ``import torch`` and its forkserver the
model code's imports (about 4 core-seconds a process).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from shardkit._local_world import private_run_dir
from shardkit.cli._fork import parent_of
from shardkit.cli.launch import launch_local

MODELING = ["transformers.models.llama.modeling_llama"]


def report() -> dict:
    """What a rank sees: its temporary directory, the launch's mark, its parent (the forkserver)
    with that process's threads and whether torch's library is mapped in it."""
    parent = os.getppid()
    with open(f"/proc/{parent}/maps") as f:
        torch_in_parent = "libtorch" in f.read()
    return {
        "rank": int(os.environ["RANK"]),
        "tmp": tempfile.gettempdir(),
        "mark": os.environ.get("SHARDKIT_TEST_MARK"),
        "parent": parent,
        "grandparent": parent_of(parent),
        "parent_threads": len(os.listdir(f"/proc/{parent}/task")),
        "torch_in_parent": torch_in_parent,
        "pid": os.getpid(),
        "session": os.getsid(0),
        "parent_session": os.getsid(parent),
    }


def hang(folder: str) -> None:
    """Say where this rank is, then wait to be killed."""
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    time.sleep(600)


def main(folder: str) -> None:
    launches = []
    for mark in ("first", "second"):
        os.environ["SHARDKIT_TEST_MARK"] = mark  # set after the first launch's forkserver started
        with private_run_dir() as run_dir:
            ranks = launch_local(2, report, run_dir=run_dir, preload=MODELING)
        launches.append(
            {
                "mark": mark,
                "run_dir": run_dir,
                "launcher": os.getpid(),
                "session": os.getsid(0),
                "ranks": list(ranks.values()),
            }
        )
    with open(os.path.join(folder, "out.json.tmp"), "w") as f:
        json.dump(launches, f)
    os.replace(os.path.join(folder, "out.json.tmp"), os.path.join(folder, "out.json"))
    with private_run_dir() as run_dir:
        launch_local(2, hang, folder, run_dir=run_dir, preload=MODELING)


if __name__ == "__main__":
    main(sys.argv[1])
