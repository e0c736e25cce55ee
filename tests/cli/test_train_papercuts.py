"""The papercuts of a fresh run (issue 32, item 6) and the profiler end to end (item 5): what a
save, a ``--keep`` removal and an interrupt say; summary rows that do not wrap in a log file;
no heartbeat left in ``--report DIR`` after a good run; one trace per rank."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from harness.limits import patient
from shardkit.checkpoint.versioned import LATEST, MANIFEST
from shardkit.cli.main import build_parser
from shardkit.cli.train import _clear_after_good_run, config_from_args, finish
from shardkit.train.options import TrainConfig
from shardkit.train.saving import last_save_note


def _args(*argv):
    return build_parser().parse_args(["train", *argv])


def test_an_interrupted_run_names_its_last_save(tmp_path):
    assert "without --checkpoint-dir DIR" in last_save_note(TrainConfig())
    root = tmp_path / "ckpt"
    assert last_save_note(TrainConfig(checkpoint_dir=str(root))) == f"no save in {root} yet: a rerun starts from step 0"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / MANIFEST).write_text(json.dumps({"step": 2}))
    (root / LATEST).write_text("step_00000002")
    save = str(root / "step_00000002")
    assert last_save_note(TrainConfig(checkpoint_dir=str(root))) == (
        f"last save: step 2 ({save}); rerun the same command with --resume to continue from it"
    )
    assert "rerun the same command to continue" in last_save_note(TrainConfig(checkpoint_dir=str(root), resume=True))
    (root / LATEST).write_text("../elsewhere")  # a damaged pointer is said, not followed
    assert last_save_note(TrainConfig(checkpoint_dir=str(root))).startswith(f"no usable save in {root}")


def test_summary_rows_do_not_wrap_in_a_log_file(capsys):
    # 32 ranks' peak memory is a 300-column row: at a fixed 120 columns it wrapped mid-row
    result = {
        "layout": {
            "nproc": 32,
            "model": "llama",
            "parallel": "dp_replicate=16 x tp=2",
            "backend": "gloo",
            "device": "cpu",
        },
        "losses": [2.0, 1.5],
        "tokens_per_s": 1000.0,
        "timings_s": {"setup": 1.0, "train": 2.0},
        "peak_memory_bytes": [123 * 2**20] * 32,
        "memory_kind": "max RSS",
        "ledger": [],
    }
    assert finish(result, config_from_args(_args())) == 0
    out = capsys.readouterr().out  # captured: not a terminal, as a log file
    rows = [line for line in out.splitlines() if "r0: 123" in line]
    assert len(rows) == 1 and "r31: 123" in rows[0] and len(rows[0]) > 120, out


def test_a_good_run_leaves_no_heartbeat(tmp_path):
    flight = tmp_path / "flight"
    flight.mkdir()
    for r in (0, 1):
        (flight / f"heartbeat-rank{r}").write_text("1.0")
    _clear_after_good_run(str(flight))
    assert not flight.exists()
    flight.mkdir()
    (flight / "heartbeat-rank1").write_text("1.0")
    (flight / "notes.txt").write_text("a user's file")
    _clear_after_good_run(str(flight), rank=1)  # torchrun: each rank its own; other files stay
    assert os.listdir(flight) == ["notes.txt"]


def test_saves_keep_profile_and_eta_are_said_in_a_run(tmp_path):
    """One real 2-rank run (about 30 s on 2 cores; the timeout bounds a hang only)."""
    report, ckpt = tmp_path / "report", tmp_path / "ckpt"
    argv = ["train", "--nproc", "2", "--tp", "2", "--steps", "3", "--seq-len", "16", "--batch-size", "2"]
    argv += ["--log-every", "1", "--report", str(report), "--checkpoint-dir", str(ckpt), "--save-every", "1"]
    argv += ["--keep", "1", "--profile-steps", "2:3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "shardkit", *argv], capture_output=True, text=True, timeout=patient(300), env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    saves = [line for line in lines if line.startswith(("saved step", "removed"))]
    assert saves == [
        f"saved step 1: {ckpt / 'step_00000001'}",
        f"saved step 2: {ckpt / 'step_00000002'}",
        f"removed {ckpt / 'step_00000001'} (--keep 1)",
        f"saved step 3: {ckpt / 'step_00000003'}",
        f"removed {ckpt / 'step_00000002'} (--keep 1)",
    ], proc.stdout
    steps = [line for line in lines if line.startswith("step ")]
    assert "  eta " in steps[1] and "eta" not in steps[0] + steps[2], steps  # from step 2, not after the last
    profile = report / "profile"
    assert f"profile (steps 2-3, one file per rank, Perfetto / memory_viz): {profile}" in proc.stdout
    for rank in (0, 1):
        with open(profile / f"rank{rank}.trace.json") as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert {"shardkit step 2", "shardkit step 3"} <= names and "shardkit step 1" not in names
    assert json.loads((report / "report.json").read_text())["profile"]["steps"] == [2, 3]
    assert not (report / "flight").exists()  # heartbeats of a good run removed


@pytest.mark.slow
def test_ctrl_c_after_a_save_names_it_and_how_to_continue(tmp_path):
    """A real 2-rank launch, SIGINT to the launcher once it said its first save (as Ctrl-C does)."""
    ckpt = tmp_path / "ckpt"
    argv = ["train", "--nproc", "2", "--tp", "2", "--steps", "500", "--seq-len", "16", "--batch-size", "2"]
    argv += ["--log-every", "1", "--checkpoint-dir", str(ckpt), "--save-every", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        [sys.executable, "-m", "shardkit", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:  # bounded by the run's 500 steps
            if line.startswith("saved step 1:"):
                break
        proc.send_signal(signal.SIGINT)
        try:
            stderr = proc.communicate(timeout=patient(120))[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 130, stderr[-3000:]
    note = next((line for line in stderr.splitlines() if "last save: step" in line), None)
    assert note is not None, stderr[-3000:]
    m = re.search(r"last save: step (\d+) \((.+)\); rerun the same command with --resume to continue from it$", note)
    assert m is not None and m.group(2) == str(ckpt / f"step_{int(m.group(1)):08d}"), note
