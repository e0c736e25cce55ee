"""The papercuts of a fresh run (issue 32, item 6): what an interrupt says; summary rows that do
not wrap in a log file; no heartbeat left in ``--report DIR`` after a good run; the ETA's steps.
What a real run's saves, ``--keep`` removals and ``--profile-steps`` (item 5) say: test_train_run.py."""

import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from harness.helpers import SMALL_CORPUS
from harness.limits import patient
from shardkit.checkpoint.versioned import LATEST, MANIFEST
from shardkit.cli.main import build_parser
from shardkit.cli.train import _clear_after_good_run, config_from_args, finish
from shardkit.train.options import TrainConfig
from shardkit.train.progress import LogLines
from shardkit.train.saving import last_save_note

CORPUS = SMALL_CORPUS  # 90 KB: the claims are not about data


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


# The save and --keep lines, the ETA and --profile-steps in a real run: test_train_run.py (one
# run for the CLI's end-to-end claims). Its --log-every 2 prints no step 1 line; this holds that
# the ETA starts at the second step and is left off the last.
def test_no_eta_before_the_second_step():
    out = io.StringIO()
    with LogLines(steps=3, tokens_per_step=8, every=1, out=out) as log:
        for step in range(3):
            log.update(step, 1.0)
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "eta" not in lines[0] and "  eta " in lines[1] and "eta" not in lines[2], lines


@pytest.mark.slow
def test_ctrl_c_after_a_save_names_it_and_how_to_continue(tmp_path):
    """A real 2-rank launch, SIGINT to the launcher once it said its first save (as Ctrl-C does)."""
    ckpt = tmp_path / "ckpt"
    argv = ["train", "--nproc", "2", "--tp", "2", "--steps", "500", "--seq-len", "16", "--batch-size", "2"]
    argv += ["--log-every", "1", "--checkpoint-dir", str(ckpt), "--save-every", "1", "--data", CORPUS]
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
