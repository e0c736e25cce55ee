"""A system temporary directory too long for the local launch's Unix socket is refused before the
launch, naming TMPDIR (not multiprocessing's ``OSError: AF_UNIX path too long`` from inside the
forkserver's start, which pytest-xdist's deep ``tmp_path`` once hit)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardkit.cli._fork import SUN_PATH_MAX, check_socket_dir
from shardkit.errors import ShardkitError

START_FORKSERVER = "import multiprocessing.forkserver as f; f.ensure_running(); print('listening')"


def _dir_of_length(base, n: int) -> str:
    path = os.path.join(str(base), "d" * (n - len(str(base)) - 1))
    assert len(path) == n
    os.makedirs(path)
    return path


def test_the_limit_is_the_platforms(short_tmp_path):
    """The longest directory the check lets through starts a real forkserver; one more byte and
    multiprocessing itself fails: the check's arithmetic is the socket's."""
    longest = SUN_PATH_MAX - len("/pymp-12345678/listener-12345678")
    for n, fits in ((longest, True), (longest + 1, False)):
        folder = _dir_of_length(short_tmp_path, n)
        env = {**os.environ, "TMPDIR": folder}
        run = subprocess.run([sys.executable, "-c", START_FORKSERVER], env=env, capture_output=True, text=True)
        assert (run.returncode == 0) is fits, (n, run.stderr[-300:])
        assert ("AF_UNIX path too long" in run.stderr) is not fits
        if fits:
            check_socket_dir(folder)
        else:
            with pytest.raises(ShardkitError, match=f"set TMPDIR to a directory of at most {longest} characters"):
                check_socket_dir(folder)


def test_shardkit_train_refuses_it_before_the_launch(short_tmp_path):
    folder = _dir_of_length(short_tmp_path, SUN_PATH_MAX)
    env = {**os.environ, "TMPDIR": folder}
    argv = [sys.executable, "-m", "shardkit", "train", "--steps", "1"]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-500:]
    assert f"shardkit train: error: the temporary directory '{folder}' is too long" in run.stderr
    assert "Traceback" not in run.stderr and "AF_UNIX" not in run.stderr
