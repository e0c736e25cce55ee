"""One real ``shardkit train`` run (4 ranks, the default layout ``dp_replicate=2 x tp=2``, with
``--verify``), and every claim about what such a run writes and says, each a test of its own.

Three tests once launched a run each (issue 32, item 4: the quick tier under 3 minutes): the
end-to-end verify and report run, the piped run (``--log-every``, a used ``--report`` folder), and
the papercuts' run (save and ``--keep`` lines, the ETA, ``--profile-steps``). One run holds all of
their flags; none of them changes what another checks (the saves and the profile happen beside the
verified steps). It trains on one 90 KB file, not the default corpus: no claim here is about data.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.helpers import SMALL_CORPUS
from harness.limits import patient

CORPUS = SMALL_CORPUS
STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run: ``(report folder, checkpoint folder, finished process)``. stdout is a pipe (not a
    terminal), and the report folder already holds an earlier run's metrics."""
    report = tmp_path_factory.mktemp("run")
    ckpt = report / "ckpt"
    (report / "metrics.jsonl").write_text(json.dumps({"run_id": "earlier", "step": 1, "loss": 9.0}) + "\n")
    argv = ["train", "--steps", str(STEPS), "--verify", "--seq-len", "32", "--batch-size", "4", "--data", CORPUS]
    argv += ["--log-every", "2", "--report", str(report)]
    argv += ["--checkpoint-dir", str(ckpt), "--save-every", "1", "--keep", "1", "--profile-steps", "2:3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(  # about 15 s on 2 quiet cores; the timeout bounds a hang only
        [sys.executable, "-m", "shardkit", *argv], capture_output=True, text=True, timeout=patient(300), env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return report, ckpt, proc


def test_end_to_end_verify_and_report(run):
    tmp_path, _, proc = run
    report = json.loads((tmp_path / "report.json").read_text())
    env = report["environment"]
    assert env["versions"]["torch"] == torch.__version__ and env["host"] and len(env["git_revision"] or "x" * 40) == 40
    layout = report["layout"]
    assert (layout["parallel"], layout["tp"], layout["dp_replicate"], layout["dp_shard"], layout["pp"]) == (
        "dp_replicate=2 x tp=2",
        2,
        2,
        1,
        1,
    )
    assert layout["sequence_parallel"] is True and layout["nproc"] == 4
    assert len(report["losses"]) == len(report["reference_losses"]) == STEPS
    assert report["parity"]["passed"] and report["parity"]["max_param_rel_diff"] <= 1e-4
    assert any(row["api"] == "sum_grad_over" for row in report["ledger"])
    assert "PASSED" in proc.stdout and (tmp_path / "loss.png").exists()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and [m["loss"] for m in lines] == report["losses"]
    assert all(m["grad_norm"] > 0 and m["lr"] == 1e-3 and m["tokens_per_s"] > 0 for m in lines)
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())  # tensorboard: test extra


def test_piped_run_logs_every_n_steps_and_starts_a_fresh_report(run):
    """stdout a pipe (not a terminal): set-up notes on stderr, a line per --log-every on stdout;
    a new run into a used --report folder keeps the earlier run's metrics under its run id."""
    tmp_path, _, proc = run
    steps = [line.split("  ")[0] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 2/3", "step 3/3"], proc.stdout
    for stage in ("joined (gloo)", "reading the corpus", "building the model (llama)", "parallelizing", "training 3"):
        assert stage in proc.stderr, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["run_id"], m["step"]) for m in lines] == [(report["run_id"], s) for s in (1, 2, 3)]
    assert json.loads((tmp_path / "runs" / "earlier" / "metrics.jsonl").read_text())["loss"] == 9.0
    assert report["parameters"] > 0 and report["mfu"] is None and "n/a on cpu" in proc.stdout
    assert "loss (mean of steps 1 -> 3)" in proc.stdout


def test_saves_keep_profile_and_eta_are_said_in_a_run(run):
    """Issue 32, items 5 and 6 in a real run: a line per save and per ``--keep`` removal, the ETA
    (from step 2, not on the last line: a line at step 1, which ``--log-every 2`` does not print,
    is held by test_train_papercuts.py::test_no_eta_before_the_second_step), one trace per rank."""
    report, ckpt, proc = run
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
    assert "  eta " in steps[0] and "eta" not in steps[1], steps  # step 2 has one, the last step none
    profile = report / "profile"
    assert f"profile (steps 2-3, one file per rank, Perfetto / memory_viz): {profile}" in proc.stdout
    for rank in range(4):
        with open(profile / f"rank{rank}.trace.json") as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert {"shardkit step 2", "shardkit step 3"} <= names and "shardkit step 1" not in names
    assert json.loads((report / "report.json").read_text())["profile"]["steps"] == [2, 3]
    assert not (report / "flight").exists()  # heartbeats of a good run removed
