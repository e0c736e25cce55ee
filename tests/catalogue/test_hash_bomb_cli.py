"""Issue 31, finding 2's done-when, through the commands a user runs: the hash-bomb checkpoint
ends within ``--timeout`` + 10 s, naming the loading phase.

A real save of ``shardkit train`` (2 ranks, ``tp=2``) has its ``.metadata`` replaced by a copy
whose first storage offset is a 100-level tuple DAG (``t = (t, t)``: 2^100 tuples to hash) or
10^7 nested tuples, built from allow-listed classes only, and the manifest's checksum rewritten
to agree (``harness.hostile``). On ``b3fae39`` both ranks of ``--resume`` hashed forever with the
GIL held and ``shardkit export`` hung the same way.

* The reader's pickle scan refuses both files before unpickling: ``shardkit train --resume
  --timeout T`` (the DAG) and ``shardkit export`` (both) end (exit code 1 and 2) within T + 10 s
  of their start, naming the checkpoint load and the file.
* The watchdog's path: the same DAG with the scan switched off in every process of the job (a
  ``sitecustomize`` in a test directory put first on ``PYTHONPATH``: the unpickling of the old
  reader), so every rank stalls together in phase ``loading`` with the GIL held. The watchdog
  stops them and the job ends within T + 10 s of the ranks' entering ``loading``, naming the phase.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from harness.helpers import SMALL_CORPUS
from harness.hostile import dag_ops, deep_ops, plant
from harness.limits import patient
from shardkit.train.liveness import read_heartbeats

SAVE = "step_00000001"
CORPUS = SMALL_CORPUS  # 90 KB, not the 31 MB default: no claim is about data
FLAGS = ["--nproc", "2", "--tp", "2", "--seq-len", "16", "--batch-size", "4", "--layers", "2", "--no-verify"]
FLAGS += ["--data", CORPUS]
BOMBS = {"a 100-level tuple DAG": (dag_ops, 100), "10^7 nested tuples": (deep_ops, 10**7)}
SITECUSTOMIZE = """\
# test-only: the reader without its pickle scan (what b3fae39 unpickled), in every process of the job
import shardkit.checkpoint.reader as _reader

_reader.scan_pickle = lambda data, file: None
"""


def _shardkit(*argv: str, env: dict | None = None, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "shardkit", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A checkpoint directory holding one save of a 2-rank ``tp=2`` run (step 1)."""
    root = str(tmp_path_factory.mktemp("hash-bomb") / "ckpt")
    done, _ = _shardkit("train", *FLAGS, "--steps", "1", "--checkpoint-dir", root, timeout=patient(300))
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def _bombed(trained: str, tmp_path, bomb: str) -> str:
    root = str(tmp_path / "ckpt")
    shutil.copytree(trained, root, symlinks=True)
    ops, levels = BOMBS[bomb]
    plant(os.path.join(root, SAVE), ops(levels))
    return root


# Each bomb through both commands; ``train --resume`` (a 2-rank launch) runs for the DAG only: the
# deep bomb meets the same scan in the same reader (it is refused by the export below, with its
# own reason), and the trainer's path after a refusal does not depend on which rule refused.
@pytest.mark.slow
@pytest.mark.parametrize("bomb", list(BOMBS))
def test_resume_and_export_of_the_hash_bomb_end_within_the_timeout_naming_the_load(trained, tmp_path, bomb):
    root = _bombed(trained, tmp_path, bomb)
    metadata = os.path.join(root, SAVE, ".metadata")
    why = "is used twice" if "DAG" in bomb else "nested more than 32 levels deep"
    timeout = patient(30)  # --timeout; the bound is measured from the command's start (start-up included)
    if "DAG" in bomb:
        done, seconds = _shardkit(
            "train", *FLAGS, "--steps", "2", "--checkpoint-dir", root, "--resume", "--timeout", f"{timeout:g}"
        )
        out = done.stdout + done.stderr
        assert done.returncode == 1, out[-3000:]
        print(f"{bomb}: train --resume {seconds:.1f} s (--timeout {timeout:g})")
        assert seconds <= timeout + 10, (seconds, out[-3000:])
        assert "load_train_state: checkpoint refused on every rank" in out, out[-3000:]
        assert f"{metadata} is refused unread" in out and why in out, out[-3000:]
    done, seconds = _shardkit("export", "--checkpoint-dir", root, "--out", str(tmp_path / "hf"))
    assert done.returncode == 2, done.stdout + done.stderr
    print(f"{bomb}: export {seconds:.1f} s")
    assert seconds <= timeout + 10, (seconds, done.stderr)
    assert done.stderr.startswith("shardkit export: error: ") and f"{metadata} is refused unread" in done.stderr
    assert why in done.stderr and not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_rank_hashing_the_bomb_is_stopped_by_the_watchdog_naming_loading(trained, tmp_path):
    root = _bombed(trained, tmp_path, "a 100-level tuple DAG")
    site, report = tmp_path / "site", tmp_path / "report"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    timeout = patient(3.0)  # the hashing ranks burn both cores until the watchdog stops them
    argv = [*FLAGS, "--steps", "2", "--checkpoint-dir", root, "--resume", "--timeout", f"{timeout:g}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    log = tmp_path / "output"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardkit", "train", *argv, "--report", str(report)], stdout=f, stderr=f, env=env
        )
    loading = None  # when a rank's beat first said it is loading
    try:
        end = time.monotonic() + patient(300)
        while proc.poll() is None and time.monotonic() < end:
            beats = read_heartbeats(str(report / "flight"))
            if loading is None and any(b.phase == "loading" for b in beats.values()):
                loading = time.monotonic()
            time.sleep(0.05)
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    beats = read_heartbeats(str(report / "flight"))
    assert loading is not None, out[-3000:]
    assert {r: b.phase for r, b in beats.items()} == {0: "loading", 1: "loading"}, (beats, out[-3000:])
    assert proc.returncode == 1, out[-3000:]
    print(f"loading -> every process gone: {ended - loading:.1f} s (--timeout {timeout:g})")
    assert ended - loading <= timeout + 10, (ended - loading, out[-3000:])
    failure = out[out.index("shardkit: a worker failed") :].splitlines()
    # every rank stalled together: the watchdog stops them (those confirmed first, any left by the
    # launcher), and the first line says why, with the phase
    assert failure[1].startswith("shardkit's watchdog stopped rank ") and failure[1].endswith(" in phase loading")
    assert "no progress for" in failure[1] and "failed first" not in out, out[-3000:]
