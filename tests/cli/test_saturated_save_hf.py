"""Issue 31, finding 1 and its done-when: ``shardkit train --tokenizer DIR --tp 2 --save-hf OUT`` on
a saturated CPU completes and writes the model.

At load ~80 the old launcher killed a healthy rank 0: after ranks 1-3 had exited, rank 0 (alone:
the gather, ``save_pretrained``, the tokenizer) missed its heartbeats for more than a 5 s grace.
Here the CPU is saturated by busy processes (``scripts/faults/saturated.py``; twice as many as
cores, plus two) and rank 0 is starved deterministically: it runs in 0.1 s SIGSTOP / SIGCONT
slices until rank 1 has left, then it is held stopped, alone and silent, for :data:`HOLD_S`
seconds in its solo phase, longer than the old grace and the old watchdog's two checks. The
launcher of ``b3fae39`` SIGKILLs rank 0 during the hold (exit code 1, ``rank 0 failed first (exit
code -9)``, no model); now the job completes with the model and its tokenizer written, and no
watchdog line. The literal run at load > 40 is ``scripts/fault_trials.py saturated``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from harness.pretrained import save_tokenizer
from shardkit.train.liveness import read_heartbeats

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from faults import saturated  # noqa: E402

BUSY = 2 * (os.cpu_count() or 2) + 2
HOLD_S = 12.0  # the old grace (5 s) + its watchdog's two checks 2 s apart + margin
TIMEOUT_S = 60.0  # --timeout: now the deadline of rank 0's solo phase too


def _run_dir(tmp: str, proc: subprocess.Popen, limit_s: float = 180.0) -> str:
    """The launch's private directory (its flight records) under ``tmp``, once it exists."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and proc.poll() is None:
        found = glob.glob(os.path.join(tmp, "shardkit-run-*"))
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError("the launch made no run directory")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_save_hf_on_a_saturated_cpu_with_rank_0_starved_alone_completes(tmp_path, short_tmp_path):
    tok = save_tokenizer(tmp_path / "tok")
    # the launch's TMPDIR holds its forkserver's socket: a short path (tmp_path is too deep under xdist)
    out, tmp, log = tmp_path / "hf", short_tmp_path, tmp_path / "output"
    argv = saturated.train_argv(str(tok), json.__file__, str(out), steps=1, nproc=2, timeout=TIMEOUT_S)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    busy: list[subprocess.Popen] = []
    with open(log, "w") as f:
        proc = subprocess.Popen([*argv, "--seq-len", "16", "--batch-size", "4"], stdout=f, stderr=f, env=env)
    try:
        flight = os.path.join(_run_dir(str(tmp), proc), "flight")
        # saturated from the ranks' first beats (model build, the steps, the solo phase), not
        # through the launcher's and its forkserver's imports: the busy processes burn both cores
        # for as long as they spin
        end = time.monotonic() + 180
        while proc.poll() is None and len(read_heartbeats(flight)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        busy = saturated.start_busy(BUSY)
        starved = saturated.starve_rank0(flight, proc, nproc=2, hold_s=HOLD_S)
        load = os.getloadavg()[0]
        proc.wait(timeout=TIMEOUT_S + 180)
    finally:
        saturated.stop_busy(busy)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    print(f"rank 0 held alone {starved['held_s']} s; {BUSY} busy processes; load {load:.1f}")
    # the starvation happened: rank 0 was held, alone and silent, past the old grace
    assert starved["held_s"] >= HOLD_S - 0.5, (starved, text[-3000:])
    assert proc.returncode == 0, (load, text[-3000:])
    assert "shardkit's watchdog" not in text and "failed first" not in text, text[-3000:]
    assert saturated.hf_written(str(out)), sorted(os.listdir(out)) if out.exists() else "no --save-hf directory"
    assert f"Hugging Face model (--save-hf, step 1): {out}" in text, text[-3000:]
